"""speculators 0.9.0's DFlashDraftModel training forward at every anchor of one sequence, read at its lm_head: what
the drafter tests compare (tests/test_dflash_speculators.py, tests/test_training_grow.py)."""
import torch


def every_anchor_logits(model, taps: torch.Tensor, ids: torch.Tensor, last: torch.Tensor, prompt: int,
                        block: int) -> torch.Tensor:
    """taps [1, n, taps * H] (the tapped layers concatenated), ids [1, n], last [1, n, H] (the verifier's last
    hidden states); the loss covers positions prompt.. . Returns [anchors, block, V] for every valid anchor (as many
    as there are: all of them, sorted, so that two models see the same draw), with the trainer's keyword arguments
    as training.train passes them on a CPU (the eager loss, not the Triton one)."""
    from speculators.model import SpeculatorModel
    n = ids.shape[1]
    loss_mask = torch.zeros(1, n, dtype=torch.long)
    loss_mask[0, prompt:] = 1
    anchors = n - block - prompt  # select_anchors leaves the row's last `block` positions out
    kwargs, _ = SpeculatorModel.registry["dflash"].get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", dflash_decay_gamma=4.0, max_anchors=anchors)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        with torch.no_grad():
            model(hidden_states=taps, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=last,
                  document_ids=torch.zeros(1, n, dtype=torch.long), **kwargs)
    finally:
        hook.remove()
    return seen[0].view(anchors, block, -1)
