"""How a job meets the cluster: launch options, the sbatch script, the rank environment."""
