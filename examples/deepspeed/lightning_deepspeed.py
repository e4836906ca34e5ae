"""Train with Lightning's DeepSpeedStrategy: ZeRO stage 3 with CPU offload, on CUDA GPUs only.

The same training as deepspeed_train.py, written as a LightningModule: Lightning builds the
DeepSpeed configuration from the arguments of DeepSpeedStrategy, starts the processes (or
takes them from srun, one task per GPU) and calls deepspeed.initialize itself. The model is
created in configure_model, which Lightning runs under ZeRO-3's partitioning, so that no
process holds the whole model. Lightning refuses this strategy on CPUs; without a GPU the
script stops at once. Rank 0 prints the loss of every epoch.

    python lightning_deepspeed.py --devices 2        # Lightning starts the second process
    srun --ntasks-per-node=2 --gpus-per-node=2 python lightning_deepspeed.py --devices 2
"""

import argparse
import datetime
import math
import os
import sys

# Read by Lightning when srun or torchrun starts the processes: checked first.
LAUNCH_VARIABLES = ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")  # fmt: skip


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--devices", type=positive_int, default=2, help="GPUs per node")
    parser.add_argument("--nodes", type=positive_int, default=1)
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per GPU")
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--fake-size", type=positive_int, default=4096, help="generated samples")
    parser.add_argument("--width", type=positive_int, default=1024, help="hidden units per layer")
    parser.add_argument("--layers", type=positive_int, default=4, help="hidden layers")
    parser.add_argument("--offload-parameters", action="store_true", help="parameters to CPU too")
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"lightning_deepspeed.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def env_int(name):
    """The whole number in environment variable `name`, or one line that names it."""
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        source = "srun" if name.startswith("SLURM_") else "torchrun, or in the job script"
        fail(f"{name}={text!r} is not a whole number (set by {source})")


def main(argv=None):
    args = parse_args(argv)
    for name in LAUNCH_VARIABLES:
        if name in os.environ:
            env_int(name)  # Lightning's own error would be a traceback
    import torch

    if not torch.cuda.is_available():
        fail(
            "Lightning's DeepSpeedStrategy runs on CUDA GPUs only and none is visible: request "
            "them with #SBATCH --gpus-per-node=2 (on CPUs, use deepspeed_train.py)"
        )
    import lightning as L
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None
            self.totals = torch.zeros(2)  # loss sum, samples

        def configure_model(self):
            if self.net is None:  # called again when a checkpoint is restored
                nn = torch.nn
                layers = []
                for _ in range(args.layers):
                    layers += [nn.Linear(args.width, args.width), nn.GELU()]
                self.net = nn.Sequential(*layers, nn.Linear(args.width, 10))

        def training_step(self, batch, batch_idx):
            inputs, labels = batch
            loss = torch.nn.functional.cross_entropy(self.net(inputs), labels)
            self.totals[0] += loss.detach() * len(labels)
            self.totals[1] += len(labels)
            return loss

        def on_train_epoch_start(self):
            self.totals = torch.zeros(2, device=self.device)

        def on_train_epoch_end(self):
            totals = self.trainer.strategy.reduce(self.totals, reduce_op="sum")
            loss_sum, samples = totals.tolist()  # the same in every rank: all stop together
            if not math.isfinite(loss_sum):
                fail(f"loss is {loss_sum / samples} at epoch {self.current_epoch + 1}, "
                     f"step {self.trainer.global_step}: lower --lr")  # fmt: skip
            if self.trainer.is_global_zero:
                print(f"epoch {self.current_epoch + 1}: loss {loss_sum / samples:.4f}")

        def configure_optimizers(self):
            # Offloaded optimizer states are updated on the CPU by DeepSpeed's C++ Adam.
            return DeepSpeedCPUAdam(self.parameters(), lr=args.lr)

    generator = torch.Generator().manual_seed(args.seed)  # the same data in every rank
    inputs = torch.randn(args.fake_size, args.width, generator=generator)
    labels = (inputs @ torch.randn(args.width, 10, generator=generator)).argmax(dim=1)
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True)

    L.seed_everything(args.seed, verbose=False)
    strategy = DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=args.offload_parameters,
        # The process group's timeout: it bounds every collective, not only the start-up.
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), loader)
    if trainer.is_global_zero:
        print(f"{trainer.world_size} processes, ZeRO stage 3, optimizer states offloaded to CPU")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("lightning_deepspeed.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
