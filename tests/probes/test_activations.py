"""Which layer makes a model's output logits, when no `get_output_embeddings()` says."""

from __future__ import annotations

from torch import nn

from nbwatch.demo import TinyGPT
from nbwatch.probes.activations import output_layer, output_layers


def paths(model: nn.Module) -> list[str]:
    return [path for path, _ in output_layers(model)]


def test_a_model_as_wide_as_its_vocabulary_has_its_head_found_not_its_blocks_linears():
    model = TinyGPT(vocab=32, d=32, layers=2, heads=2, ctx=16)  # the demo's d = V
    assert paths(model) == ["head"]
    assert output_layer(model) == ("head", model.head)


def test_a_sequential_model_keeps_its_last_layer_and_a_tied_head_wins():
    seq = nn.Sequential(nn.Embedding(16, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
                        nn.Linear(16, 16))
    assert paths(seq) == ["2"]
    emb = nn.Embedding(16, 16)
    tied = nn.ModuleDict({"emb": emb, "mix": nn.Linear(16, 16), "out": nn.Linear(16, 16)})
    tied["out"].weight = emb.weight
    assert paths(tied) == ["out"]


def test_two_nets_each_keep_their_head():
    model = nn.ModuleDict({"student": TinyGPT(vocab=32, d=32, layers=1, heads=2, ctx=16),
                           "teacher": TinyGPT(vocab=32, d=32, layers=1, heads=2, ctx=16)})
    assert paths(model) == ["student.head", "teacher.head"]


def test_learned_positions_outnumbering_a_char_vocabulary_do_not_hide_the_head():
    """A char-level GPT with 65 tokens and 256 learned positions (nanoGPT's
    shakespeare_char shape, untied): its head maps onto 65, not onto the 256 rows of the
    largest embedding."""
    model = TinyGPT(vocab=65, d=32, layers=2, heads=2, ctx=256)
    assert paths(model) == ["head"]


def test_a_classifier_of_a_hugging_face_shape_gets_no_output_layer():
    """A model that says it has no output embeddings (a sequence classifier) has none,
    even where its 2 classes match a 2-row type embedding."""

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.words, self.types = nn.Embedding(100, 16), nn.Embedding(2, 16)
            self.classifier = nn.Linear(16, 2)

        def get_output_embeddings(self):
            return None

    assert paths(Classifier()) == []
