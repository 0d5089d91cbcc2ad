"""The layer stacks and the stages as tables of rows (LayerConfig, Stage): each column is a flag declared once by its
field, a preset picks a stack and a stage table, and the records' tables make the models and schedules the records
describe."""
import dataclasses
import re

import pytest

import train_gpt
from conftest import REPO_ROOT
from train_gpt import LayerConfig, Stage


def tiny(*flags):
    return train_gpt.parse_args(["--preset", "tiny", *flags], cuda=False)


def test_each_column_is_one_flag_whose_help_is_its_fields():
    fields = {field.name: field for field in dataclasses.fields(train_gpt.Hyperparameters)}
    for column in dataclasses.fields(LayerConfig):
        flag = fields[f"{column.name}_layers"]
        assert flag.default is None and flag.metadata["help"] == column.metadata["help"]
    names = {column.name: fields[column.metadata["flag"]] for column in dataclasses.fields(Stage)}
    assert sorted(flag.name for flag in names.values()) == ["candidates", "doc_max_tokens", "stage_lr", "stage_shares",
                                                           "train_seq_len", "window_blocks"]
    assert all(flag.default is None and flag.metadata["help"] == dataclasses.fields(Stage)[k].metadata["help"]
               for k, flag in enumerate(names.values()))


def test_a_layer_columns_flag_sets_that_column_in_the_layers_it_lists_and_nothing_else():
    # every column, one layer at a time turned on or off in the tiny stack: where the run accepts it, the stack is the
    # table's with that one cell changed (each column has such a layer); and a flag listing a column's own layers
    # gives the table back
    table = train_gpt.PRESETS["tiny"].layers
    assert train_gpt.layer_stack(tiny()) == table
    for column in dataclasses.fields(LayerConfig):
        on = [i for i, row in enumerate(table) if getattr(row, column.name)]
        assert train_gpt.layer_stack(tiny(f"--{column.name}_layers={','.join(map(str, on))}")) == table
        changed = 0
        for i in range(len(table)):
            layers = sorted(set(on) ^ {i})
            if not train_gpt.accepted(lambda: tiny(f"--{column.name}_layers={','.join(map(str, layers))}")):
                continue
            rows = train_gpt.layer_stack(tiny(f"--{column.name}_layers={','.join(map(str, layers))}"))
            expected = list(table)
            expected[i] = dataclasses.replace(table[i], **{column.name: not getattr(table[i], column.name)})
            assert list(rows) == expected, (column.name, i)
            changed += 1
        assert changed, column.name


def test_num_layers_cuts_the_stack_or_adds_plain_rows_after_it():
    table = train_gpt.PRESETS["tiny"].layers
    assert train_gpt.layer_stack(tiny("--num_layers", "5", "--skip_layers", "1,3")) == table[:5]
    rows = train_gpt.layer_stack(tiny("--num_layers", "8"))
    assert rows[:6] == table and rows[6:] == (LayerConfig(),) * 2
    assert train_gpt.model_config(tiny("--num_layers", "8")).dense_layer == 7  # (MUDD's: the last, a plain row)


def test_89s_and_92s_tables_are_the_stacks_their_records_describe():
    # #89: attention but in layer 6, long windows (with the key offset) in 3 and 10, paired heads in 0, 2, 5, 9; #92:
    # attention in 7 layers, narrow queries and keys in 0, 1, 2, 5, 8, values in 1 and 8, no MLP in 7 and two in 8,
    # x0 in 0, 1, 2, 4, 5, 7, 10 and the n-gram embedding in 0, 1, 4, 5, 9, 10 (its config.py's lists)
    def listed(rows, name):
        return [i for i, row in enumerate(rows) if getattr(row, name)]
    r89, r92 = train_gpt.RECORD89_LAYERS, train_gpt.RECORD92_LAYERS
    assert [listed(r89, name) for name in ("attention_free", "long_window", "key_offset", "paired_head",
                                           "value_embed", "xsa", "output_gate", "dc", "gate_network")] == \
        [[6], [3, 10], [3, 10], [0, 2, 5, 9], [1, 2, 8, 9, 10], [1, 3, 4, 7], [3, 10], [10], [0, 4]]
    assert [listed(r92, name) for name in ("attention_free", "narrow_qk", "narrow_v", "mlp_free", "double_mlp", "x0",
                                           "ngram", "paired_head", "xsa", "value_embed")] == \
        [[4, 6, 7, 9], [0, 1, 2, 5, 8], [1, 8], [7], [8], [0, 1, 2, 4, 5, 7, 10], [0, 1, 4, 5, 9, 10], [0, 2, 5],
         [1, 3], [1, 2, 8, 10]]


def test_92s_stage_table_gives_its_stages_and_scales_them_to_a_shorter_run():
    record = train_gpt.parse_args(["--preset", "record"], cuda=False)
    assert train_gpt.stage_starts(record) == [0, 320, 681, 1107, 1174, 1194]
    assert train_gpt.candidate_counts(record) == [(0, 10240), (681, 14336), (965, 24576), (1107, 0)]
    table = train_gpt.schedule_table(record).splitlines()
    assert table[3].split() == ["2", "681-1106", "49152", "3072", "1.73", "5:11", "14336:14336:24576", "4", "yes"]
    assert table[5].split() == ["extension", "1174-1193", "16384", "3072", "final", "6:13", "all", "4", "to", "step",
                                "1175"]
    assert table[2].split()[-5:-1] == ["2,", "4", "from", "336"]  # (#92's cadence changes 16 steps into stage 1)
    # half the run: each stage half as long by its share, rounded (320 x 577 / 1174 = 157.3, ...)
    half = train_gpt.parse_args(["--preset", "record", "--num_iterations", "597"], cuda=False)
    assert train_gpt.stage_starts(half) == [0, 157, 335, 544, 577, 597]


def test_the_cpu_presets_table_splits_its_thirds_where_92s_candidates_change():
    # its windows change at its thirds (steps 73 and 147 of 220), its candidate counts at #92's steps' shares of
    # its run (125, 178, 204)
    cpu = train_gpt.parse_args(["--preset", "cpu"], cuda=False)
    windows = {step: train_gpt.window_tokens(step, cpu) for step in range(220)}
    assert all(windows[step] == ((64, 128) if step < 73 else (128, 256) if step < 147 else (256, 256))
               for step in windows)
    assert train_gpt.candidate_counts(cpu) == [(0, 10240), (125, 14336), (178, 24576), (204, 0)]


@pytest.mark.parametrize("flags", [["--stage_shares", "1,2"], ["--stage_shares", "3,1,1,1"]])
def test_another_count_of_stages_takes_each_column_the_preset_gives_one_value(flags):
    # the tiny preset's columns are one value throughout but its windows: a count of stages of one's own needs them
    with pytest.raises(train_gpt.UserError, match=re.escape("have a --window_blocks each ('1:1,1:2,2:2,2:2'): give "
                                                            "--window_blocks too")):
        tiny(*flags)
    count = len(flags[1].split(","))
    args = tiny(*flags, "--window_blocks", "1:2")
    rows = train_gpt.stage_table(args)
    assert len(rows) == count + 1 and {row.train_seq_len for row in rows} == {256}
    assert [row.share for row in rows[:-1]] == [float(share) for share in flags[1].split(",")]


def test_the_model_and_optimizer_sections_name_no_record_by_a_string():
    # a record's choices are data (its tables, MuddHead and recipes) or a module of its own, never a string such as
    # "89" the code branches on
    source = (REPO_ROOT / "train_gpt.py").read_text()
    for title in ("Optimizers", "Model"):
        start = source.index(f"\n# {title}")
        text = source[start:source.index("\n# ----", start)]
        assert not re.findall(r"""["'](?:23|89|92)["']""", text), title
