#!/bin/bash
# Slurm: 2 nodes x 4 GPUs, one task per GPU. srun starts every process; ddpkit reads SLURM_PROCID,
# SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE and SLURM_STEP_ID (set by srun
# only: this batch script itself stays one process). The store is on the first host of the step's
# SLURM_STEP_NODELIST, at a port hashed from SLURM_JOB_ID plus SLURM_STEP_ID (two steps of this job at once get
# two stores); export MASTER_ADDR / MASTER_PORT to choose them. No launcher, no scontrol.
#SBATCH --job-name=ddpkit-digits
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=00:30:00

export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
srun python examples/digits.py --epochs 8
