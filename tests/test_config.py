import pytest

from dense_trainer.config import Config, load_config, parse_override
from dlrm_core.errors import ConfigError

from .conftest import REPO


def test_defaults_and_field_docs():
    cfg = Config()
    assert cfg.embedding.optimizer.kind == "adagrad"
    # Every field of every section carries a docstring.
    for section in [
        cfg.data,
        cfg.embedding,
        cfg.model,
        cfg.optim,
        cfg.train,
        cfg.embedding.optimizer,
    ]:
        for name, field in type(section).model_fields.items():
            assert field.description, f"{type(section).__name__}.{name} has no docstring"


def test_precedence_cli_over_file_over_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nbatch_size = 100\nepochs = 3\n[embedding]\ndim = 8\n")
    cfg = load_config(toml, [{"train": {"epochs": 5}}])
    assert cfg.train.epochs == 5  # flag
    assert cfg.train.batch_size == 100  # file
    assert cfg.train.eval_batch_size == Config().train.eval_batch_size  # default
    assert cfg.embedding.dim == 8


def test_unknown_key_names_it_and_suggests(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nepoch = 3\n")
    with pytest.raises(
        ConfigError, match=r"c.toml: train.epoch: unknown setting \(did you mean 'epochs'\?\)"
    ):
        load_config(toml)


def test_bad_value_names_field(tmp_path):
    with pytest.raises(
        ConfigError, match=r"command line: model.interaction: .*'dot' or 'dcn'.*got 'dcnn'"
    ):
        load_config(None, [parse_override("model.interaction=dcnn")])
    with pytest.raises(
        ConfigError, match=r"train.batch_size: Input should be greater than or equal to 1"
    ):
        load_config(None, [{"train": {"batch_size": 0}}])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_override_parsing():
    assert parse_override("optim.lr=0.002") == {"optim": {"lr": 0.002}}
    assert parse_override("model.interaction=dcn") == {"model": {"interaction": "dcn"}}
    assert parse_override("model.over_arch_layer_sizes=[8, 4]") == {
        "model": {"over_arch_layer_sizes": [8, 4]}
    }
    with pytest.raises(ConfigError):
        parse_override("nonsense")


def test_shipped_configs_load_and_kaggle_tables():
    tiny = load_config(REPO / "configs" / "tiny.toml")
    assert tiny.embedding.dim == 8
    kaggle = load_config(REPO / "configs" / "criteo-kaggle.toml").feature_spec()
    rows = [t.rows for t in kaggle.tables]
    assert max(rows) == 10_000_000 and rows[0] == 1460 and len(rows) == 26
    capped = load_config(
        REPO / "configs" / "criteo-kaggle.toml", [{"embedding": {"hash_size": 1000}}]
    )
    assert max(t.rows for t in capped.feature_spec().tables) == 1000
    with pytest.raises(ConfigError, match="unknown table 'C99'"):
        load_config(None, [{"embedding": {"tables": [{"name": "C99", "rows": 5}]}}]).feature_spec()
