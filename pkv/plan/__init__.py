"""Planning a decode step: the split rule and host schedules (v3), the device-side split rule's CPU oracle (v4), and the roofline cost model the router applies."""
