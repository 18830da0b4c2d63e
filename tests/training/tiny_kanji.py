"""The tiny kanji training configuration the training tests share."""
from training.config import TrainConfig

FONTS = ("ipag", "ipam", "seto", "kouzan-sousyo", "ume-gothic", "ukai")


def tiny(tmp_path, kanji_root, **kw):
    base = dict(dataset="kanji", data_root=kanji_root, num_classes=20, image_size=32, kanji_fonts=FONTS,
                backbone="small_cnn", weights="none", embed_dim=16, epochs=3, batch_size=16,
                m_per_class=4, out=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                progress=False, lr=1e-3)
    base.update(kw)
    return TrainConfig(**base)
