#!/usr/bin/env python3
"""The book's mdBook preprocessor (docs/book/book.toml): fills the pages
that are made from the code and the docs rather than written in the book.

- `{{#space-openapi}}` becomes the API reference, rendered from the OpenAPI
  document the server serves at `/v1/openapi.json`: the JSON file named by
  SPACE_OPENAPI_JSON, else printed by the space-server example `openapi`
  (cargo run). A page written by hand would drift from the routes.
- `{{#space-decisions}}` becomes every docs/decisions/NNN-*.md in order,
  each under an anchor named after its file, so a decision added there
  appears without editing the book.

mdBook runs it twice: `supports RENDERER` (every renderer is), then with
[context, book] as JSON on stdin, expecting the book back on stdout.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DECISIONS = ROOT / "docs" / "decisions"
METHODS = ["get", "put", "post", "patch", "delete", "head", "options", "trace"]


def openapi_document():
    path = os.environ.get("SPACE_OPENAPI_JSON")
    if path:
        return json.loads(Path(path).read_text())
    printed = subprocess.run(
        ["cargo", "run", "--quiet", "--locked", "-p", "space-server", "--example", "openapi"],
        cwd=ROOT, check=True, stdout=subprocess.PIPE,
    )
    return json.loads(printed.stdout)


def cell(text):
    """Text fit for one cell of a markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def schema_anchor(name):
    return "schema-" + re.sub(r"[^A-Za-z0-9_-]", "-", name)


def type_of(schema):
    """A schema in a few words: `string`, `[Sandbox]`, `Sandbox | null`..."""
    if not isinstance(schema, dict) or not schema:
        return "any"
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{schema_anchor(name)})"
    for combinator, joiner in (("oneOf", " \\| "), ("anyOf", " \\| "), ("allOf", " & ")):
        if combinator in schema:
            return joiner.join(type_of(s) for s in schema[combinator])
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    words = []
    for k in kinds:
        if k == "array":
            words.append(f"array of {type_of(schema.get('items', {}))}")
        elif k == "object" and isinstance(schema.get("additionalProperties"), dict):
            words.append(f"map of {type_of(schema['additionalProperties'])}")
        elif k not in (None, "null"):
            fmt = schema.get("format")
            words.append(f"{k} ({fmt})" if fmt else k)
    if "null" in kinds:
        words.append("null")
    if "enum" in schema:
        words.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"] if v is not None))
    return " \\| ".join(words) or "any"


def description_of(schema):
    """A schema's description, or that of its one described variant (an
    optional reference carries its description beside the `$ref`)."""
    if not isinstance(schema, dict):
        return ""
    if schema.get("description"):
        return schema["description"]
    for variant in schema.get("oneOf", []) + schema.get("anyOf", []):
        if isinstance(variant, dict) and variant.get("description"):
            return variant["description"]
    return ""


def render_properties(schema, out):
    required = set(schema.get("required", []))
    props = schema.get("properties", {})
    if not props:
        return
    out += ["| field | type | required | description |", "|---|---|---|---|"]
    for name, prop in props.items():
        description = description_of(prop)
        out.append(f"| `{name}` | {type_of(prop)} | {'yes' if name in required else ''} | {cell(description)} |")
    out.append("")


def render_openapi(doc):
    out = []
    info = doc.get("info", {})
    out += [
        f"OpenAPI {doc.get('openapi', '')}, *{info.get('title', '')}* version {info.get('version', '')}: "
        "this page is rendered, when the book is built, from the document every server serves at "
        "`GET /v1/openapi.json` (the server's own code prints it: "
        "`cargo run -p space-server --example openapi`).",
        "",
    ]
    groups = {}
    for path, item in doc.get("paths", {}).items():
        for method in METHODS:
            op = item.get(method)
            if op:
                tag = (op.get("tags") or ["other"])[0]
                groups.setdefault(tag, []).append((method, path, op, item.get("parameters", [])))
    out += ["## Operations", ""]
    for tag, ops in groups.items():
        out += [f"### {tag}", ""]
        for method, path, op, shared_params in ops:
            anchor = "op-" + (op.get("operationId") or f"{method}-{path}")
            anchor = re.sub(r"[^A-Za-z0-9_-]", "-", anchor)
            out += [f'<a id="{anchor}"></a>', "", f"#### `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [op["summary"], ""]
            if op.get("description") and op.get("description") != op.get("summary"):
                out += [op["description"], ""]
            params = shared_params + op.get("parameters", [])
            if params:
                out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
                for p in params:
                    out.append(
                        f"| `{p.get('name')}` | {p.get('in')} | {type_of(p.get('schema', {}))} | "
                        f"{'yes' if p.get('required') else ''} | {cell(p.get('description', ''))} |"
                    )
                out.append("")
            body = op.get("requestBody")
            if body:
                for content_type, media in body.get("content", {}).items():
                    out.append(f"Request body (`{content_type}`"
                               f"{', required' if body.get('required') else ''}): {type_of(media.get('schema', {}))}")
                out.append("")
            responses = op.get("responses", {})
            if responses:
                out += ["| status | description | body |", "|---|---|---|"]
                for status, response in responses.items():
                    bodies = [f"`{ct}` {type_of(m.get('schema', {})) if m.get('schema') else ''}".strip()
                              for ct, m in response.get("content", {}).items()]
                    out.append(f"| {status} | {cell(response.get('description', ''))} | {cell('; '.join(bodies))} |")
                out.append("")
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        out += ["## Schemas", ""]
        for name in sorted(schemas, key=str.lower):
            schema = schemas[name]
            out += [f'<a id="{schema_anchor(name)}"></a>', "", f"### `{name}`", ""]
            if schema.get("description"):
                out += [schema["description"], ""]
            if schema.get("properties"):
                render_properties(schema, out)
            else:
                out += [f"{type_of(schema)}", ""]
            for combinator in ("oneOf", "anyOf", "allOf"):
                for variant in schema.get(combinator, []):
                    if isinstance(variant, dict) and variant.get("properties"):
                        if variant.get("description"):
                            out += [f"*{cell(variant['description'])}*", ""]
                        render_properties(variant, out)
    schemes = doc.get("components", {}).get("securitySchemes", {})
    if schemes:
        out += ["## Authentication", ""]
        for name, scheme in schemes.items():
            out.append(f"- `{name}`: {scheme.get('type', '')} {scheme.get('scheme', '')}".rstrip())
        out.append("")
    return "\n".join(out)


def render_decisions():
    out = []
    for path in sorted(DECISIONS.glob("[0-9][0-9][0-9]-*.md")):
        lines = path.read_text().splitlines()
        out += [f'<a id="{path.stem}"></a>', ""]
        # Each file's own headings go one level down, under the page's title.
        for line in lines:
            out.append("#" + line if re.match(r"#{1,5} ", line) else line)
        out += ["", f"*From `docs/decisions/{path.name}`.*", ""]
    return "\n".join(out)


def chapters(items):
    for item in items:
        chapter = item.get("Chapter") if isinstance(item, dict) else None
        if chapter:
            yield chapter
            yield from chapters(chapter.get("sub_items", []))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "supports":
        sys.exit(0)
    _context, book = json.load(sys.stdin)
    sections = book.get("sections", book.get("items", []))
    fillers = {"{{#space-openapi}}": lambda: render_openapi(openapi_document()), "{{#space-decisions}}": render_decisions}
    for chapter in chapters(sections):
        for marker, fill in fillers.items():
            if marker in chapter["content"]:
                chapter["content"] = chapter["content"].replace(marker, fill())
    json.dump(book, sys.stdout)


if __name__ == "__main__":
    main()
