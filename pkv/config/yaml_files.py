"""Config files as YAML, read strictly: a key given twice in one mapping, or a document that
contains itself through an alias, is one ConfigError line (file, line) instead of the last
key silently winning or a reader recursing without end. Imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

from pkv.config.errors import ConfigError


def strict_yaml(text: str, source: str):
    """YAML as yaml.safe_load reads it, but a key given twice in one mapping is refused
    (file and line), instead of the last one silently winning."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: key {key!r} given twice (first on "
                                      f"line {seen[key] + 1}); one of them would silently be ignored")
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    try:
        _refuse_cycles(yaml.compose(text, Loader=Loader), source)
        return yaml.load(text, Loader=Loader)   # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None


def _refuse_cycles(root, source: str) -> None:
    """Refuse a document that contains itself through an alias (`a: &x [1, *x]`): every
    reader of a config walks it to its leaves, so it would recurse without end."""
    import yaml

    stack = [(root, ())]
    while stack:
        node, ancestors = stack.pop()
        if any(node is a for a in ancestors):
            raise ConfigError(f"{source}:{node.start_mark.line + 1}: a YAML alias refers to the node that contains "
                              "it (the anchor on this line); a config cannot contain itself")
        if isinstance(node, yaml.SequenceNode):
            stack += [(child, (*ancestors, node)) for child in node.value]
        elif isinstance(node, yaml.MappingNode):
            stack += [(child, (*ancestors, node)) for pair in node.value for child in pair]


def read_config_file(path: str | Path) -> dict:
    """A config file (config.yaml, a --configfile) read by strict_yaml."""
    try:
        doc = strict_yaml(Path(path).read_text(), str(path))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys, got {type(doc).__name__}")
    return doc or {}
