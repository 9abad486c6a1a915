"""Running a whole job: the job config split into step configs (`job`), the runner that starts and supervises the
steps (`runner`) on a backend (`launchers`), their logs under the run root (`step_logs`) and the live progress
line (`progress`)."""
