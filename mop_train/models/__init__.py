"""The MoE decoder family (GQA or MLA attention, routed SwiGLU experts behind the dispatch seam,
aux-loss-free router balancing) and its named configs.

    from mop_train.models import zoo
    model = zoo.build_model("debug")            # MoETransformer on CPU, initialised
    hidden = model(tokens)                      # [B, S, H]; logits would be hidden @ model.output.weight.T
"""

from mop_train.models.args import MoEModelArgs
from mop_train.models.model import MoETransformer, TransformerBlock

__all__ = ["MoEModelArgs", "MoETransformer", "TransformerBlock"]
