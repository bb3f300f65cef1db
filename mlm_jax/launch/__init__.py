"""The launchers' logic: options, checks, defaults and every command they run.

launch/tpu_pod.sh and launch/slurm_gpu.sh only find this repository and a
python3, then call `tpu.main` or `slurm.main`. This package imports the
Python standard library only: it runs on a workstation or a login node that
has neither jax nor the rest of mlm_jax installed.
"""
