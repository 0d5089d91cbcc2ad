"""The record path reads alone: from the top of train_gpt.py to the end of train() a reader meets the machinery
below only as a few named calls, and the FP8, optimizer and model sections hold no layout code."""
import ast

from conftest import REPO_ROOT

SOURCE = (REPO_ROOT / "train_gpt.py").read_text()


def names_in(node: ast.AST) -> set[str]:
    """The names a node reads, those in string annotations ("ParallelContext", "PipelineStage | None") included."""
    names = {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)}
    annotations = [sub.annotation for sub in ast.walk(node) if isinstance(sub, (ast.arg, ast.AnnAssign))] + \
        [sub.returns for sub in ast.walk(node) if isinstance(sub, ast.FunctionDef)]
    for annotation in filter(None, annotations):
        for sub in ast.walk(annotation):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                names |= names_in(ast.parse(sub.value, mode="eval"))
    return names


def names_used_above_train_defined_below() -> set[str]:
    """Top-level names defined below the end of train() that the code above it reads."""
    tree = ast.parse(SOURCE)
    defined = {}
    for node in tree.body:
        targets = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
        for name in targets:
            defined.setdefault(name, node.lineno)
    end = next(node.end_lineno for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train")
    above = [node for node in tree.body if node.lineno <= end]
    local = {sub.id for node in above if isinstance(node, (ast.FunctionDef, ast.ClassDef)) for sub in ast.walk(node)
             if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)}  # (a function's own variables)
    return {name for node in above for name in names_in(node) if defined.get(name, 0) > end and name not in local}


def test_the_record_path_meets_at_most_five_names_defined_below_it():
    used = names_used_above_train_defined_below()
    assert len(used) <= 5, sorted(used)
    assert {"apply_layout", "RunKeeper"} <= used  # the two seams: the layout applied, the run kept


def section(title: str) -> str:
    """The text of the section whose banner comment starts with title."""
    start = SOURCE.index(f"\n# {title}")
    return SOURCE[start:SOURCE.index("\n# ----", start)]


def test_the_fp8_optimizer_and_model_sections_hold_no_layout_code():
    for title in ("FP8 matmul", "Optimizers", "Model"):
        for word in ("slice_of", "own_slice", "full_shape", "count_comm", "exchange_updates", "dist.", "use_flex",
                     "full_shapes"):
            assert word not in section(title), (title, word)


def test_importing_the_trainer_starts_no_compiler():
    """torch.compile's start-up (about 2 s) is paid at first use, not by each process that imports the file (every
    test, tool, rank, and `--help`)."""
    import subprocess
    import sys
    started = subprocess.run([sys.executable, "-c", "import sys, train_gpt; print(sorted(m for m in sys.modules "
                              "if m.startswith(('torch._dynamo', 'torch._inductor'))))"],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert started == "[]", started
