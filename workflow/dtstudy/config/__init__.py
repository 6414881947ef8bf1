"""The study config, torch-free: its JSON schema and messages (`schema`), and reading, merging and
slicing a config (`study_config`). The checks that need the other layers are `dtstudy.checks`."""
