"""Learning-rate schedules, values as torch.optim.lr_scheduler's.

Each is a closed-form function of the step count (`last_epoch`, torch's name; step() may be
called per epoch or per iteration), so a schedule resumes from its state_dict exactly. It
sets `optimizer.lr` on construction (step 0) and on every step().
"""
import bisect
import math


class LRScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self.last_epoch = 0
        optimizer.lr = self.lr_at(0)

    def lr_at(self, epoch):
        raise NotImplementedError

    def step(self):
        self.last_epoch += 1
        self.optimizer.lr = self.lr_at(self.last_epoch)

    def get_last_lr(self):
        return [self.optimizer.lr]

    def state_dict(self):
        return {"base_lr": self.base_lr, "last_epoch": self.last_epoch}

    def load_state_dict(self, state):
        self.base_lr = state["base_lr"]
        self.last_epoch = state["last_epoch"]
        self.optimizer.lr = self.lr_at(self.last_epoch)


class StepLR(LRScheduler):
    """lr = base_lr * gamma ** (epoch // step_size)."""

    def __init__(self, optimizer, step_size, gamma=0.1):
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer)

    def lr_at(self, epoch):
        return self.base_lr * self.gamma ** (epoch // self.step_size)


class MultiStepLR(LRScheduler):
    """lr = base_lr * gamma ** (number of milestones <= epoch)."""

    def __init__(self, optimizer, milestones, gamma=0.1):
        self.milestones = sorted(milestones)
        self.gamma = gamma
        super().__init__(optimizer)

    def lr_at(self, epoch):
        return self.base_lr * self.gamma ** bisect.bisect_right(self.milestones, epoch)


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (base_lr - eta_min) (1 + cos(pi epoch / T_max)) / 2 (periodic past
    T_max, as torch's)."""

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer)

    def lr_at(self, epoch):
        return self.eta_min + (self.base_lr - self.eta_min) * (
            1 + math.cos(math.pi * epoch / self.T_max)) / 2


class LinearWarmup(LRScheduler):
    """Multiplies `scheduler`'s lr by a factor rising linearly from start_factor to 1 over
    warmup_steps steps, and steps it along (the gradual warm-up of Goyal et al. 2017; the
    same values as torch's ChainedScheduler([LinearLR(opt, start_factor, 1.0, warmup_steps),
    scheduler])). Call step() on the LinearWarmup only."""

    def __init__(self, scheduler, warmup_steps, start_factor=1.0 / 3):
        if warmup_steps < 1 or not 0 < start_factor <= 1:
            raise ValueError(f"LinearWarmup: need warmup_steps >= 1 and 0 < start_factor <= 1, "
                             f"got {warmup_steps}, {start_factor}")
        self.scheduler = scheduler
        self.warmup_steps = warmup_steps
        self.start_factor = start_factor
        super().__init__(scheduler.optimizer)
        self.last_epoch = scheduler.last_epoch
        self.optimizer.lr = self.lr_at(self.last_epoch)

    def lr_at(self, epoch):
        done = min(epoch, self.warmup_steps) / self.warmup_steps
        return self.scheduler.lr_at(epoch) * (self.start_factor + (1 - self.start_factor) * done)

    def step(self):
        self.scheduler.step()
        super().step()

    def state_dict(self):
        return dict(super().state_dict(), scheduler=self.scheduler.state_dict())

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state["scheduler"])
        super().load_state_dict(state)
