"""Planning a decode step: the split rule and host schedules, the device-side split rule's CPU
oracle, and the roofline cost model the router applies."""
