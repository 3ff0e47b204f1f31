"""Build the default prompt set from the held-out stdlib modules.

What this is: each prompt is one function's (or method's) signature plus its docstring, cut right after
the closing quotes and dedented (or, for a function without a docstring, its signature plus its first
simple statement), taken from the modules that ``pipeline.train_pair.training`` held out of
training. The model is then asked to write the body. Rows are ``{"id", "prompt"}``, where ``id`` is
``<module path>:<qualified name>:<line>``, stable across runs of the same Python version.

What this is not: a tokenizer or a model. The tokenizer is only used to drop prompts longer than
``max_prompt_tokens`` (BOS included), so that a prompt plus the generated tokens fits the context.

Run: ``python -m pipeline.train_pair.prompts --pair train_out/pair --out assets/prompts.jsonl``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import textwrap
from pathlib import Path

_COMPOUND = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Match,
) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def _function_prompts(module_path: str, source: str) -> list[tuple[str, str]]:
    """(id, prompt) for every function in one module, in source order: its signature plus its docstring,
    or, without a docstring, plus its first statement when that is a simple (one-clause) statement."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = [*scope, child.name]
                first = child.body[0]
                with_docstring = ast.get_docstring(child) is not None
                if not isinstance(child, ast.ClassDef) and (
                    with_docstring or not isinstance(first, _COMPOUND)
                ):
                    snippet = lines[child.lineno - 1 : first.end_lineno]
                    snippet[-1] = snippet[-1][: first.end_col_offset]
                    text = textwrap.dedent("\n".join(snippet))
                    if text and not text[0].isspace():
                        found.append((child.lineno, ".".join(qualname), text))
                visit(child, qualname)

    visit(tree, [])
    found.sort()
    return [(f"{module_path}:{qualname}:{lineno}", text) for lineno, qualname, text in found]


def build_prompts(
    root: Path,
    heldout_modules: list[str],
    tokenizer,
    *,
    max_prompt_tokens: int = 200,
    max_prompts: int = 1000,
) -> list[dict]:
    """Prompts from the held-out modules: deduplicated, at most ``max_prompt_tokens`` tokens each.

    When more than ``max_prompts`` qualify, a deterministic spread (lowest sha1 of the id) is kept.
    Rows come back sorted by id.
    """
    rows, seen = [], set()
    for module_path in heldout_modules:
        try:
            source = (Path(root) / module_path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for prompt_id, text in _function_prompts(module_path, source):
            if text in seen:
                continue
            if len(tokenizer(text)["input_ids"]) > max_prompt_tokens:
                continue
            seen.add(text)
            rows.append({"id": prompt_id, "prompt": text})
    if len(rows) > max_prompts:
        rows.sort(key=lambda row: hashlib.sha1(row["id"].encode()).hexdigest())
        rows = rows[:max_prompts]
    rows.sort(key=lambda row: row["id"])
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({"id": row["id"], "prompt": row["prompt"]}, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pair", required=True, help="a trained pair directory (with manifest.json, target/)"
    )
    parser.add_argument("--out", required=True, help="output JSONL path")
    parser.add_argument("--max-prompt-tokens", type=int, default=200)
    parser.add_argument("--max-prompts", type=int, default=1000)
    args = parser.parse_args(argv)
    pair = Path(args.pair)
    manifest = json.loads((pair / "manifest.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    rows = build_prompts(
        Path(manifest["stdlib_dir"]),
        manifest["heldout_modules"],
        tokenizer,
        max_prompt_tokens=args.max_prompt_tokens,
        max_prompts=args.max_prompts,
    )
    write_jsonl(rows, Path(args.out))
    print(f"wrote {len(rows)} prompts from {len(manifest['heldout_modules'])} held-out modules to {args.out}")


if __name__ == "__main__":
    main()
