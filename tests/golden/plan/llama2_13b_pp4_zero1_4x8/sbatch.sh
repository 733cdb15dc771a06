#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=2
#SBATCH --error=/path/to/results/runs/r/submitit/%j/%j_0_log.err
#SBATCH --gpus-per-node=8
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/path/to/results/runs/r/submitit/%j/%j_0_log.out
#SBATCH --signal=USR2@90
#SBATCH --time=60

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /path/to/results/runs/r/submitit/%j/%j_%t_log.out --error /path/to/results/runs/r/submitit/%j/%j_%t_log.err python -u -m submitit.core._submit /path/to/results/runs/r/submitit/%j
