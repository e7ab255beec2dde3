"""Pure logic: what each launcher's variables mean."""
import pytest

from ddpkit.core.environment import LaunchEnvError, ProcessEnv, detect, legacy_local_rank


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
    from ddpkit.core.environment import expand_hostlist, slurm_port

    environ = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
               "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]",
               "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    env = detect(environ, [])
    assert (env.master_addr, env.master_port, env.node_rank) == ("gpu07", slurm_port(123456, 0), 1)
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


# What srun sets in each task (srun(1), OUTPUT ENVIRONMENT VARIABLES), for `srun -N2 -n3 python train.py` in job
# 123456 on gpu[07-08]: block distribution puts tasks 0 and 1 on gpu07 and task 2 on gpu08. SLURM_NODEID,
# SLURM_LOCALID and the STEP_* variables describe the step, SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE the job.
UNEVEN_STEP = {"SLURM_JOB_ID": "123456", "SLURM_JOBID": "123456", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
               "SLURM_NTASKS": "3", "SLURM_NPROCS": "3", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
               "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "2,1",
               "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "3",
               "SLURM_STEP_TASKS_PER_NODE": "2,1"}


def _task(step, procid, nodeid, localid, **extra):
    return {**step, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid), "SLURM_LOCALID": str(localid),
            **extra}


def test_slurm_uneven_tasks_per_node():
    envs = [detect(_task(UNEVEN_STEP, *task), []) for task in ((0, 0, 0), (1, 0, 1), (2, 1, 0))]
    assert [(e.rank, e.local_rank, e.local_world_size, e.node_rank, e.world_size) for e in envs] == \
        [(0, 0, 2, 0, 3), (1, 1, 2, 0, 3), (2, 0, 1, 1, 3)]
    assert len({(e.master_addr, e.master_port) for e in envs}) == 1 and envs[0].master_addr == "gpu07"


def test_slurm_tasks_per_node_with_repeats():
    from ddpkit.core.environment import tasks_per_node

    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]
    step = {**UNEVEN_STEP, "SLURM_NTASKS": "7", "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_NUM_NODES": "4",
            "SLURM_NNODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_NODELIST": "n[1-4]"}
    env = detect(_task(step, 6, 3, 0), [])
    assert (env.local_world_size, env.node_rank) == (1, 3)
    assert detect(_task(step, 3, 1, 1), []).local_world_size == 2


def test_two_concurrent_srun_steps_do_not_share_a_store():
    # `srun -N1 -n2 ... &` twice in one allocation: step 0 on gpu07, step 1 on gpu08, or both on the same node
    step0 = {**UNEVEN_STEP, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "gpu07"}
    step1 = {**step0, "SLURM_STEP_ID": "1", "SLURM_STEPID": "1", "SLURM_STEP_NODELIST": "gpu08"}
    a, b = detect(_task(step0, 0, 0, 0), []), detect(_task(step1, 0, 0, 0), [])
    assert (a.master_addr, b.master_addr) == ("gpu07", "gpu08") and a.master_port != b.master_port
    same_node = detect(_task({**step1, "SLURM_STEP_NODELIST": "gpu07"}, 0, 0, 0), [])
    assert same_node.master_addr == "gpu07" and same_node.master_port != a.master_port


def test_slurm_ports_of_jobs_10000_apart_differ_and_stay_below_the_ephemeral_range():
    from ddpkit.core.environment import slurm_port

    assert slurm_port(123456, 0) != slurm_port(133456, 0) != slurm_port(143456, 0)
    assert slurm_port(123456, 0) != slurm_port(123456, 1)
    ports = {slurm_port(job, step) for job in range(1000, 1200) for step in range(5)}
    assert len(ports) > 950 and all(10000 <= p < 32768 for p in ports)


def test_slurm_ports_of_two_jobs_collide_as_rarely_as_the_docstring_says_whatever_their_ids():
    """1 / 22768 per pair of jobs, also for ids a round number apart (a sequential job counter makes those
    common): 200000 pairs at each gap expect 8.8 collisions; 3x that is far outside chance (Poisson)."""
    from ddpkit.core.environment import SLURM_PORTS, slurm_port

    first, pairs = 100000, 200000
    ports = [slurm_port(job, 0) for job in range(first, first + pairs + 20000)]
    expected = pairs / len(SLURM_PORTS)
    for gap in (1, 7, 1000, 10000, 20000):
        collisions = sum(ports[i] == ports[i + gap] for i in range(pairs))
        assert collisions < 3 * expected, f"ids {gap} apart: {collisions} collisions, expected {expected:.1f}"


def test_mpirun_inside_a_slurm_allocation_is_mpi():
    # Open MPI's mpirun starts its daemons with srun: each rank inherits its node daemon's SLURM_PROCID (the node
    # index) and SLURM_NTASKS (the node count). MPI's own variables say what this process is.
    daemon = {**UNEVEN_STEP, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
              "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_LOCALID": "0"}
    env = detect({**daemon, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                  "MASTER_ADDR": "gpu07", "MASTER_PORT": "29400"}, [])
    assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("mpi", 3, 4, 1, 2)
    hydra = detect({**daemon, "PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
                    "MASTER_ADDR": "gpu07", "MASTER_PORT": "29400"}, [])
    assert (hydra.source, hydra.rank, hydra.world_size) == ("mpi", 2, 4)


def test_srun_with_pmi_keeps_slurms_local_ranks():
    # `srun --mpi=pmi2 -N2 -n4`: srun itself starts the ranks and sets PMI_RANK / PMI_SIZE, with no local rank:
    # Slurm's variables describe the same launch, and know the nodes
    step = {**UNEVEN_STEP, "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    env = detect({**_task(step, 3, 1, 1), "PMI_RANK": "3", "PMI_SIZE": "4"}, [])
    assert (env.rank, env.local_rank, env.local_world_size, env.node_rank) == (3, 1, 2, 1)


def test_srun_keeping_the_callers_environment_with_pmi_keeps_slurms_local_ranks():
    # `srun -E --mpi=pmi2 -N2 -n4` inside a 12-task allocation: -E keeps the caller's SLURM_NTASKS (the job's
    # 12); the step's own count is SLURM_STEP_NUM_TASKS, which PMI_SIZE matches
    job = {**UNEVEN_STEP, "SLURM_NTASKS": "12", "SLURM_NPROCS": "12", "SLURM_TASKS_PER_NODE": "6(x2)"}
    step = {**job, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    envs = [detect({**_task(step, rank, rank // 2, rank % 2), "PMI_RANK": str(rank), "PMI_SIZE": "4"}, [])
            for rank in range(4)]
    assert [(e.source, e.rank, e.world_size, e.local_rank, e.local_world_size, e.node_rank) for e in envs] == \
        [("slurm", r, 4, r % 2, 2, r // 2) for r in range(4)]
    old = {k: v for k, v in step.items() if not k.startswith("SLURM_STEP_NUM")}  # a Slurm without STEP_NUM_*
    env = detect({**_task({**old, "SLURM_NTASKS": "4"}, 3, 1, 1), "PMI_RANK": "3", "PMI_SIZE": "4"}, [])
    assert (env.source, env.local_rank, env.local_world_size) == ("slurm", 1, 2)


def test_a_slurm_node_id_outside_the_steps_nodes_is_one_line_naming_both_variables():
    for nodeid in ("2", "-1"):  # UNEVEN_STEP has 2 nodes: "2,1"
        with pytest.raises(LaunchEnvError) as raised:
            detect(_task(UNEVEN_STEP, 2, nodeid, 0), [])
        text = str(raised.value)
        assert f"SLURM_NODEID={nodeid}" in text and "SLURM_STEP_TASKS_PER_NODE='2,1'" in text and "\n" not in text
        assert "2 nodes" in text
    # a heterogeneous step (`srun ... : ...`): Slurm offsets SLURM_NODEID and SLURM_PROCID by the component's
    # first node and task, and sets the STEP_* variables for the whole step (its env.c, env_array_for_step)
    het = {**UNEVEN_STEP, "SLURM_HET_SIZE": "2", "SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_NUM_NODES": "3",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_STEP_NODELIST": "gpu[07-09]"}
    env = detect(_task(het, 4, 2, 0), [])
    assert (env.rank, env.world_size, env.local_world_size, env.node_rank) == (4, 5, 1, 2)
