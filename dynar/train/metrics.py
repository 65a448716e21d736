"""What evaluation counts: held-out loss, and how many samples have their label among the k
highest logits."""
import numpy as np


def top_k_correct(logits, labels, k):
    """The number of rows of logits (N, K) whose label is among their k largest values (any
    label when k >= K), a tie counted for the label; a row holding a NaN counts as wrong."""
    finite = ~np.isnan(logits).any(axis=1)
    if k >= logits.shape[1]:
        return int(np.count_nonzero(finite))
    mine = np.take_along_axis(logits, labels[:, None], axis=1)
    # The label is in the top k when fewer than k logits beat it.
    return int(np.count_nonzero(((logits > mine).sum(axis=1) < k) & finite))


def held_out(model, loader, loss, job_sum, num_classes):
    """{loss, accuracy, top5, images} of `model`, put in eval mode meanwhile, over every
    rank's shard of loader's split, `job_sum` adding the counts over ranks; top5 is None for
    5 classes or fewer."""
    totals = np.zeros(4)   # loss sum, top-1 correct, top-5 correct, count
    model.eval()
    try:
        for x, y in loader.batches(0):
            if len(y) == 0:
                continue
            logits = model.forward(x)
            totals += (loss.forward(logits, y) * len(y), top_k_correct(logits, y, 1),
                       top_k_correct(logits, y, 5), len(y))
    finally:
        model.train()
    total_loss, top1, top5, count = job_sum(totals)
    return {"loss": total_loss / count, "accuracy": top1 / count,
            "top5": top5 / count if num_classes > 5 else None, "images": int(count)}
