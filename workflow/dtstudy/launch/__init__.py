"""Starting a run's processes: submitit jobs (`launcher`, `job`), the warm pool (`pool`), a
task's process body (`rank_process`) and process group (`process_group`), cores and ports."""
