"""Lightning under Slurm: a Trainer that disagrees with srun, and Slurm variables that leak.

When srun starts the processes, Lightning's SLURMEnvironment reads the ranks from the Slurm
variables and checks that the Trainer agrees with the allocation: `devices` must equal
--ntasks-per-node and `num_nodes` must equal --nodes, or fit() stops with a ValueError. The
same variables also exist where a script runs without srun inside an allocation (a batch
script, an salloc shell with a job name of its own): it sees SLURM_NTASKS=2, believes srun
started it as one of two tasks, and waits for the second one, 30 minutes by default, at
"Initializing distributed". Lightning ignores Slurm for jobs named "bash" or "interactive". The
script trains a tiny model with the DDP strategy and a short --init-timeout, so that wait ends
within seconds. The fixes: pass devices and num_nodes that match the allocation (or read them
from SLURM_NTASKS_PER_NODE and SLURM_NNODES), start the tasks with srun, and for one process
in an allocation name the job "interactive" (salloc --job-name=interactive, or
SLURM_JOB_NAME=interactive python ...).

    srun --ntasks-per-node=2 python lightning_slurm.py --devices 1     # ValueError: You set ...
    python lightning_slurm.py --devices 2      # in a 2-task job, without srun: waits, times out
    SLURM_JOB_NAME=interactive python lightning_slurm.py             # Lightning ignores Slurm
"""

import argparse
import datetime
import os
import sys


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--devices", type=positive_int, default=1, help="processes per node")
    parser.add_argument("--num-nodes", type=positive_int, default=1)
    parser.add_argument(
        "--init-timeout", type=positive_int, default=30, help="seconds to wait for ranks"
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"lightning_slurm.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_env():
    """The numbers Lightning reads from the environment: one line, not a traceback."""
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
                 "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "MASTER_PORT"):  # fmt: skip
        text = os.environ.get(name)
        if text is not None and not text.isdecimal():
            fail(f"{name}={text!r} is not a whole number (set by Slurm, or in the job script)")


def main(argv=None):
    args = parse_args(argv)
    check_env()
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.layer(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    names = ("SLURM_JOB_NAME", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES")
    print("Slurm: " + ", ".join(f"{name}={os.environ.get(name, '-')}" for name in names))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=DDPStrategy(timeout=datetime.timedelta(seconds=args.init_timeout)),
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=16))
    environment = type(trainer.strategy.cluster_environment).__name__
    print(f"rank {trainer.global_rank} of {trainer.world_size} ({environment}): trained")
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("lightning_slurm.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
