"""Where a file turns Ray's token authentication off, by any of the ways YAML, shell and Python can.

NAME below is RAY_AUTH_MODE (spelled out only in the code, so that this text is not a finding).
Ray 2.60 turns authentication on only for NAME=token (any case); every other value, the empty one
included, turns it off (`ray._raylet.get_authentication_mode()` reads 'disabled', 'foo' and '' all
as DISABLED), and KubeRay's `authOptions.mode` has the same two states. So the scan is an
allow-list: wherever a file *sets* NAME or `authOptions.mode`, the value must be the literal
`token`; a value it cannot read (`$MODE`, `${MODE:-token}`, a ConfigMap reference, a variable) is
reported too, since a deployer can make it anything. Unsetting NAME is reported: `ray start` then
runs without authentication unless a token file happens to exist. Ray's system-config entry
AUTH_MODE (`ray.init(_system_config=...)`, `ray start --system-config`) is held to the same rule:
measured on Ray 2.60 with RAY_AUTH_MODE=token, that entry `disabled` made the driver read its mode
as DISABLED and the GCS hand its cluster id to a client without a token (refused at the GCS
without the entry); the raylet still refused that client and the Jobs API still answered 401.

How each kind of file is read:
- YAML (and JSON): parsed, every document walked with line numbers. A mapping key `authOptions`,
  an env map entry NAME with a value, an env list entry with `name` NAME and its `value` (KubeRay,
  Kubernetes; `valueFrom` counts as unreadable); every string scalar is also read as shell text,
  and a multi-line one (a ConfigMap's embedded RayJob) is parsed and walked as YAML too. `${X}`
  placeholders (cluster/render.sh's envsubst templates, which are not YAML until rendered) are
  swapped for inert words while parsing and put back before any value is judged.
- Python: the syntax tree. An item assignment of NAME (os.environ or any env dict), `del` of it,
  calls with NAME then a value (`setdefault`, `putenv`, `monkeypatch.setenv`, ...), `pop`,
  `unsetenv`, `delenv`, keyword NAME (`dict(...)`, `env.update(...)`), dict literals with the key
  NAME or with `name` NAME and a `value`; names are resolved through the module's own string
  constants. Every string constant is also read as shell text (a `shell=True` command line, an
  `["env", ...]` argument list, a `python -c` program).
- Everything else (shell scripts, Makefile, Dockerfile, Markdown, TOML): shell text, below, and a
  Markdown file's ```yaml blocks as YAML.

Shell text (`SHELL_FORMS`): NAME then `=`, ` = `, `?=`, `:=` and a value (shell, export, env,
docker -e, make, dotenv, TOML, pytest-env), NAME then `:` (flow YAML, JSON, a Python dict),
expansion defaults `${NAME:-V}` and `${NAME:=V}`, Dockerfile `ENV NAME V`, `unset`, `env -u`,
Python item assignments and setting calls, and KubeRay's flow and block forms (the env entry with
its value on the next line, `authOptions` with `mode` inline or below) where a heredoc or a doc
carries YAML that is not parsed here.

Not seen: a value built at run time from other variables (`env = {k: v for ...}`, the name itself
concatenated), and comments in YAML and Python (they configure nothing).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

NAME = "RAY_AUTH_MODE"
# keys that set the mode: the variable, and its entry in Ray's system config (the docstring)
KEYS = (NAME, "AUTH_MODE")
_KEY = f"(?:RAY_)?{KEYS[1]}"
ON = "token"
# a value as shell, YAML or Python writes it: double- or single-quoted, a ${...} expansion (and
# what follows it), or a bare word
_WORDS = (r'"[^"\n]*"', r"'[^'\n]*'", r"\$\{[^}\n]*\}[^\s;&|)\]},'\"#]*", r"[^\s;&|)\]},`'\"#]*")
_VALUE = "(" + "|".join(_WORDS) + ")"
_Q = r"""["']?"""
SHELL_FORMS = {
    "set": re.compile(rf"(?<![\w$]){_Q}{_KEY}{_Q}[ \t]*(?:[:?+!]?=|:(?![-=?+]))[ \t]*{_VALUE}"),
    "expansion default": re.compile(rf"\$\{{{NAME}:?[-=?+]([^}}\n]*)\}}"),
    "Dockerfile ENV": re.compile(rf"^[ \t]*ENV[ \t]+{NAME}[ \t]+{_VALUE}", re.MULTILINE),
    "Python item set": re.compile(rf"\[\s*['\"]{_KEY}['\"]\s*\]\s*=\s*{_VALUE}"),
    "call setting it": re.compile(rf"(?<!\.get)(?<!getenv)(?<!\.pop)\(\s*['\"]{_KEY}['\"]\s*,\s*{_VALUE}"),
    "env list entry": re.compile(rf"{_Q}name{_Q}\s*:\s*{_Q}{NAME}{_Q}[ \t]*,\s*{_Q}value{_Q}\s*:\s*{_VALUE}"),
    "env list entry (block)": re.compile(rf"name:[ \t]*{_Q}{NAME}{_Q}[ \t]*(?:#.*)?\n[ \t]*value:[ \t]*{_VALUE}"),
    "env list entry (value first)": re.compile(rf"value:[ \t]*{_VALUE}[ \t]*(?:#.*)?\n[ \t]*name:[ \t]*{_Q}{NAME}"),
    "authOptions": re.compile(rf"authOptions{_Q}\s*:\s*\{{\s*{_Q}mode{_Q}\s*:\s*{_VALUE}"),
    "authOptions (block)": re.compile(rf"authOptions:[ \t]*(?:#.*)?\n[ \t]*mode:[ \t]*{_VALUE}"),
}
SHELL_UNSETS = re.compile(
    rf"\bunset[ \t]+(?:-v[ \t]+)?(?:\w+[ \t]+)*{NAME}\b|\benv\b[^\n]*?(?:-u[ \t]*|--unset[= ]){NAME}\b"
)
UNSETTING_CALLS = {"pop", "unsetenv", "delenv"}
READING_CALLS = {"get", "getenv", "__getitem__", "__contains__"}
PLACEHOLDER = re.compile(r"\$\{[^}\n]*\}")


def is_on(value) -> bool:
    """The literal `token`, quoted or not, any case; a full stop or comma after it is prose's."""
    return isinstance(value, str) and value.strip().rstrip(".,").strip("\"'").lower() == ON


def judged(value, where: str) -> list[str]:
    """[] if `value` keeps authentication on, else one finding naming it."""
    return [] if is_on(value) else [f"{where} (only the literal {ON!r} keeps token authentication on)"]


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def shell_findings(text: str, first_line: int = 1) -> list[tuple[int, str]]:
    """(line, what) for every form of shell text above that sets a value other than `token`."""
    found = []
    for form, pattern in SHELL_FORMS.items():
        for match in pattern.finditer(text):
            line = first_line + line_of(text, match.start(1)) - 1  # the value's line
            found += [(line, f) for f in judged(match.group(1), f"{form}: {match.group(0).strip()!r}")]
    for match in SHELL_UNSETS.finditer(text):
        found.append((first_line + line_of(text, match.start()) - 1, f"unsets {NAME}: {match.group(0)!r}"))
    return found


# ------------------------------------------------------------------------------------------ YAML


def protect(text: str) -> tuple[str, dict[str, str]]:
    """`${...}` placeholders swapped for inert words (a template parses as YAML) and the way back."""
    originals = {}

    def swap(match: re.Match) -> str:
        word = f"mdcplaceholder{len(originals)}x"
        originals[word] = match.group(0)
        return word

    return PLACEHOLDER.sub(swap, text), originals


def restore(value: str, originals: dict[str, str]) -> str:
    for word, original in originals.items():
        value = value.replace(word, original)
    return value


def yaml_findings(text: str, first_line: int = 1) -> list[tuple[int, str]]:
    """(line, what) for every YAML document in `text`; a text that does not parse is a finding."""
    protected, originals = protect(text)
    try:
        documents = list(yaml.compose_all(protected))
    except yaml.YAMLError as err:
        return [(first_line, f"not parseable as YAML, so not checked: {str(err).splitlines()[0]}")]
    found = []
    for document in documents:
        found += walk_yaml(document, originals, first_line)
    return found


def walk_yaml(node, originals: dict[str, str], first_line: int) -> list[tuple[int, str]]:
    line = first_line + node.start_mark.line if node is not None else first_line
    if isinstance(node, yaml.ScalarNode):
        value = restore(node.value, originals)
        if "\n" in value.strip() and embedded_yaml(value):  # a ConfigMap's file: walked as YAML
            return yaml_findings(value, line + 1)
        return shell_findings(value, line)
    if isinstance(node, yaml.SequenceNode):
        return [f for item in node.value for f in walk_yaml(item, originals, first_line)]
    if not isinstance(node, yaml.MappingNode):
        return []
    found = mapping_findings(node, originals, line)
    for key, value in node.value:
        found += walk_yaml(key, originals, first_line) + walk_yaml(value, originals, first_line)
    return found


def embedded_yaml(text: str) -> bool:
    """Whether a multi-line string is a YAML collection (not a shell script or prose)."""
    try:
        return isinstance(yaml.compose(protect(text)[0]), (yaml.MappingNode, yaml.SequenceNode))
    except yaml.YAMLError:
        return False


def mapping_findings(node: yaml.MappingNode, originals: dict[str, str], line: int) -> list[tuple[int, str]]:
    """The settings one mapping makes: `authOptions`, `NAME: V`, `{name: NAME, value: V}`, each
    named at the line of its value (or of what stands where the value should be)."""

    def plain(n):
        return restore(n.value, originals) if isinstance(n, yaml.ScalarNode) else None

    def at(n) -> int:
        return line + n.start_mark.line - node.start_mark.line

    entries = {plain(k): v for k, v in node.value}
    found = []
    if "authOptions" in entries:
        options = entries["authOptions"]
        settings = {plain(k): v for k, v in options.value} if isinstance(options, yaml.MappingNode) else {}
        mode = settings.get("mode", options)
        found += [(at(mode), f) for f in judged(plain(settings.get("mode")), f"authOptions: mode {plain(mode)!r}")]
    for key in (k for k in KEYS if k in entries):
        found += [(at(entries[key]), f) for f in judged(plain(entries[key]), f"{key}: {plain(entries[key])!r}")]
    if "name" in entries and plain(entries["name"]) == NAME:
        value = entries.get("value", entries["name"])
        what = f"env entry {NAME}: value {plain(value)!r}" if "value" in entries else f"env entry {NAME}, no value"
        found += [(at(value), f) for f in judged(plain(entries.get("value")), what)]
    return found


# ---------------------------------------------------------------------------------------- Python


def python_findings(text: str) -> list[tuple[int, str]]:
    """(line, what) for every setting or unsetting of NAME in a Python module's syntax tree, and
    the shell forms in its string constants."""
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        return [(err.lineno or 1, f"not parseable as Python, so not checked: {err.msg}")]
    constants = string_constants(tree)

    def resolved(node):
        if isinstance(node, ast.Constant):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        found += [(node.lineno, what) for what in python_node_findings(node, resolved)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += shell_findings(node.value, node.lineno)
    return found


def string_constants(tree: ast.AST) -> dict[str, str]:
    """Names bound to one string literal everywhere in the module (NAME = "RAY_AUTH_MODE")."""
    values: dict[str, set] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value.value if isinstance(node.value, ast.Constant) else object()
            values.setdefault(node.targets[0].id, set()).add(value)
    return {name: next(iter(v)) for name, v in values.items() if len(v) == 1 and isinstance(next(iter(v)), str)}


def python_node_findings(node: ast.AST, resolved) -> list[str]:
    """What one syntax node does to NAME: [] when it keeps or only reads it."""
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Subscript) and resolved(t.slice) in KEYS for t in targets):
            return judged(resolved(node.value), f"{ast.unparse(targets[0])} = {ast.unparse(node.value)}")
    if isinstance(node, ast.Delete) and any(
        isinstance(t, ast.Subscript) and resolved(t.slice) == NAME for t in node.targets
    ):
        return [f"unsets {NAME}: {ast.unparse(node)}"]
    if isinstance(node, ast.Call):
        return python_call_findings(node, resolved)
    if isinstance(node, ast.Dict):
        entries = {resolved(k): v for k, v in zip(node.keys, node.values) if k is not None}
        found = [
            f
            for k in KEYS
            if k in entries
            for f in judged(resolved(entries[k]), f"{{{k!r}: {ast.unparse(entries[k])}}}")
        ]
        if "name" in entries and resolved(entries["name"]) == NAME:
            value = entries.get("value")
            found += judged(resolved(value) if value else None, f"env entry {NAME}: {ast.unparse(node)}")
        return found
    return []


def python_call_findings(node: ast.Call, resolved) -> list[str]:
    method = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    found = [
        f
        for keyword in node.keywords
        if keyword.arg in KEYS
        for f in judged(resolved(keyword.value), f"{method}({keyword.arg}={ast.unparse(keyword.value)})")
    ]
    if not node.args or resolved(node.args[0]) not in KEYS or method in READING_CALLS:
        return found
    if method in UNSETTING_CALLS and resolved(node.args[0]) == NAME:
        return found + [f"unsets {NAME}: {ast.unparse(node)}"]
    if len(node.args) >= 2:
        found += judged(resolved(node.args[1]), f"{ast.unparse(node)}")
    return found


# ----------------------------------------------------------------------------------------- files


def file_findings(path: Path) -> list[tuple[int, str]]:
    """(line, what) for one file, read by its kind."""
    text = path.read_text(errors="ignore")
    if path.suffix == ".py":
        return python_findings(text)
    if path.suffix in (".yaml", ".yml", ".json"):
        return yaml_findings(text)
    found = shell_findings(text)
    if path.suffix == ".md":
        for block in re.finditer(r"^```ya?ml[ \t]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            found += yaml_findings(block.group(1), line_of(text, block.start(1)))
    return found


def scan(paths) -> list[str]:
    """'path:line: what' for every finding in `paths`, in order."""
    return [f"{path}:{line}: {what}" for path in paths for line, what in sorted(set(file_findings(Path(path))))]
