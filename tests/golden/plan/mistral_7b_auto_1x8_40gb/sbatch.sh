#!/bin/bash
#SBATCH --job-name=zerosnake-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --mem=512G
#SBATCH --time=24:00:00
#SBATCH --partition=gpu

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
srun torchrun --nnodes=1 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:29500" -m pipeline.train
