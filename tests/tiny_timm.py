"""A tiny ViT registered with timm for the tests: `timm:dml_test_vit` (vit_tiny_patch16_224's
configuration and hub id, with 8-px patches, 3 blocks of width 32, built for 32 px)."""
import timm
from timm.models import register_model
from timm.models.vision_transformer import _create_vision_transformer

NAME = "timm:dml_test_vit"
HUB_ID = "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # the configuration it borrows names this repo


if not timm.is_model("dml_test_vit"):
    @register_model
    def dml_test_vit(pretrained=False, **kw):
        args = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, mlp_ratio=2.0)
        return _create_vision_transformer("vit_tiny_patch16_224", pretrained=pretrained, **(args | kw))
