#!/bin/bash
# Slurm: 2 nodes x 4 GPUs, one task per GPU. srun starts every process; ddpkit reads SLURM_PROCID,
# SLURM_LOCALID, SLURM_NTASKS, SLURM_STEP_ID (set by srun only), the first host of SLURM_JOB_NODELIST (master address) and a port derived
# from SLURM_JOB_ID. No launcher, no scontrol.
#SBATCH --job-name=ddpkit-digits
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=00:30:00

export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
srun python examples/digits.py --epochs 8
