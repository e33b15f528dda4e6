"""Engine sets: one core, `-dp N` cores on this machine, or `--ray` replicas, behind `EngineSet`."""
