"""A run's data: the dataset, this rank's loaders over its train and held-out splits, and
what they tell the log (how they are fed, the unreadable images they skipped)."""
import numpy as np

from .. import data


class RunData:
    """`ds` read as `cfg` says, on this rank of `job`, beside `threads` compute threads. The
    decode workers default to the cores those threads leave free."""

    def __init__(self, cfg, ds, job, threads):
        self.ds, self.job, self.cfg = ds, job, cfg
        self.images = isinstance(ds, data.ImageDataset)   # decoded from files as it trains
        if cfg.augment is None:                 # a packed set: as it says
            cfg.augment = ds.augment_by_default
        self.workers = cfg.data_workers if cfg.data_workers is not None else \
            data.pipeline.default_workers(job.node_share(), threads)
        feed = dict(workers=self.workers, skip_bad=cfg.skip_bad_images)
        self.train = data.Loader(ds, cfg.batch_size, job.rank, job.world, augment=cfg.augment,
                                 seed=cfg.seed, micro_batches=cfg.accumulate, **feed)
        self.held_out = data.Loader(ds, cfg.batch_size, job.rank, job.world, split="test",
                                    **feed) if len(ds.y_test) else None
        if cfg.eval_only and self.held_out is None:
            raise ValueError(f"--eval-only: {ds.name} has no held-out split to evaluate")

    @property
    def loaders(self):
        return [loader for loader in (self.train, self.held_out) if loader is not None]

    def describe(self):
        """The start's account of the data and how it is fed."""
        ds = self.ds
        if not self.images:
            return f"data: {ds.name}, {self.train.describe()}"
        default = "" if self.cfg.data_workers is not None \
            else " (default: --data-workers N to change)"
        text = (f"data: {ds.name} from {ds.source}, {ds.num_classes} classes, "
                f"{len(ds.y_train)} train / {len(ds.y_test)} held-out images; train "
                f"{self.train.describe()}{default}")
        if self.held_out is not None:
            text += f"; eval {self.held_out.transform.name}"
        return "; ".join([text] + list(ds.notes))

    def announce(self, report):
        """The data's start line, and for images a log record naming source and classes."""
        pipeline = self.describe()
        report.message(pipeline)
        if self.images:
            report.event({"event": "data", "dataset": self.ds.name, "source": self.ds.source,
                          "classes": list(self.ds.classes), "pipeline": pipeline,
                          "data_workers": self.workers})

    def count_bad_images(self, report, epoch):
        """Collective: the unreadable images first met this epoch (--skip-bad-images),
        counted over ranks and reported."""
        if not (self.images and self.cfg.skip_bad_images):
            return None
        names = [name for loader in self.loaders for name in loader.images.take_bad_files()]
        total = int(self.job.sum(np.array([float(len(names))]))[0])
        report.bad_images(epoch, total, names)
        return total

    def close(self):
        for loader in self.loaders:
            loader.close()
