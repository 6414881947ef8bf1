"""The study projected past the machine: hardware profiles, calibration from measurements, the
communication benchmark, layer profiles and the projection tables and plot."""
