"""fairseq-train that also saves, on every data-parallel rank, the model's
parameters whenever a checkpoint is saved (``<save_dir>/rank<R>.pt``), so a
test can compare the ranks' parameters.  Arguments: those of fairseq-train."""

import torch

from fairseq import checkpoint_utils
from fairseq_cli import train

save_checkpoint = checkpoint_utils.save_checkpoint


def save_checkpoint_and_rank_state(cfg, trainer, epoch_itr, val_loss):
    result = save_checkpoint(cfg, trainer, epoch_itr, val_loss)
    torch.save(trainer.get_model().state_dict(), f"{cfg.save_dir}/rank{trainer.data_parallel_rank}.pt")
    return result


checkpoint_utils.save_checkpoint = save_checkpoint_and_rank_state

if __name__ == "__main__":
    train.cli_main()
