"""The host bench's bar, torch-free: the bench marks each FlashInfer row against it and the
report (pkv.report.host) states it: an adapter's prepare() may take at most
BAR_FACTOR x FlashInfer's raw plan() + BAR_US µs."""

BAR_FACTOR, BAR_US = 1.10, 10.0
