"""Pure logic: what each launcher's variables mean."""
import pytest

from ddpkit.environment import LaunchEnvError, ProcessEnv, detect, legacy_local_rank


def test_plain_python_is_single():
    env = detect({}, ["train.py"])
    assert (env.source, env.rank, env.world_size, env.local_rank, env.distributed) == ("single", 0, 1, 0, False)


def test_torchrun_variables():
    env = detect({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}, [])
    assert (env.source, env.rank, env.local_rank, env.world_size, env.node_rank) == ("torchrun", 3, 1, 4, 1)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29400)


@pytest.mark.parametrize("argv", [["t.py", "--local_rank=1"], ["t.py", "--local-rank", "1"]])
def test_legacy_launch_local_rank_argument(argv):
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, argv)
    assert (env.source, env.local_rank, env.local_world_size, env.node_rank) == ("legacy-launch", 1, 2, 0)
    assert legacy_local_rank(["t.py"]) is None


def test_slurm_srun_variables():
    env = detect({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
                  "SLURM_STEP_ID": "0"}, [])
    assert (env.source, env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == \
        ("slurm", 5, 1, 8, 4, 1)


def test_sbatch_script_without_srun_is_single():
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, []).source == "single"


def test_torchrun_wins_over_slurm():
    env = detect({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1",
                  "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0"}, [])
    assert env.source == "torchrun"


@pytest.mark.parametrize("environ, fragment", [
    ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "rank 2 is outside world size 2"),
    ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
])
def test_inconsistent_variables_are_clear_errors(environ, fragment):
    with pytest.raises(LaunchEnvError, match=fragment):
        detect(environ, [])


def test_process_env_validates_local_rank():
    with pytest.raises(LaunchEnvError, match="local rank 2"):
        ProcessEnv("torchrun", 0, 2, 4, 2)


def test_slurm_master_address_and_port_from_the_job():
    from ddpkit.environment import expand_hostlist, slurm_port

    environ = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
               "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]",
               "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    env = detect(environ, [])
    assert (env.master_addr, env.master_port, env.node_rank) == ("gpu07", slurm_port(123456), 1)
    assert detect({**environ, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "4000"}, []).master_addr == "10.1.1.1"
    assert expand_hostlist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("n[9-11]") == ["n9", "n10", "n11"]


@pytest.mark.parametrize("environ, expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 1, 4, 1)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (2, 0, 4, 1)),
])
def test_mpirun_variables(environ, expected):
    env = detect({**environ, "MASTER_ADDR": "head", "MASTER_PORT": "29400"}, [])
    assert env.source == "mpi" and (env.rank, env.local_rank, env.world_size, env.node_rank) == expected


def test_kubeflow_pytorchjob_variables_are_torchrun_style():
    env = detect({"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}, [])
    assert (env.source, env.rank, env.world_size, env.master_addr) == ("torchrun", 2, 3, "job-master-0")
    assert (env.local_rank, env.node_rank) == (0, 2)  # one process per pod
