"""ColossalAI-style training facade for ring sequence parallelism.

    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    booster = Booster(plugin=RingSequenceParallelPlugin(sp_size=2, layout="zigzag"))
    model, optimizer, criterion, loader, _ = booster.boost(model, optimizer, dataloader=loader)

Files: ``base.py`` (the Plugin surface), ``ring_plugin.py`` (the plugin and the gradient math),
``booster.py``, ``mesh.py`` ((dp, sp, tp) groups), ``policy.py`` (switching attention),
``dataloader.py`` (dp sampling + sequence sharding), ``precision.py``, ``wrappers.py`` (model,
optimizer, loss), ``checkpoint.py`` (replicated state), ``sharded_checkpoint.py`` (any mesh:
full model state dicts, distributed optimizer state). Tensor parallelism, FSDP and activation
checkpointing live in ``ringseq.parallel`` (docs/parallelism.md). Importing this package does
not import transformers.
"""
from .base import Plugin
from .booster import Booster
from .policy import sdpa_on_ring
from .ring_plugin import RingSequenceParallelPlugin
from .wrappers import SequenceParallelLoss

__all__ = ["Booster", "Plugin", "RingSequenceParallelPlugin", "SequenceParallelLoss",
           "sdpa_on_ring"]
