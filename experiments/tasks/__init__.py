"""The tasks the configs name: models written for one device, data modules, LR schedules."""
