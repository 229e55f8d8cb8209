"""The scheduler: owns every request and decides each step's batch (`scheduler.Scheduler`); its
process (`worker`)."""
