"""Running `pagebus serve` as a daemon: sd_notify, config files and PAGEBUS_* variables, JSON logs,
forward-progress (stall) tracking and the systemd unit writer."""
