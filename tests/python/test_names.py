"""The names C++ and Python share have one owner (issue #31): src/common/env_names.h for the
environment variables, src/agent/control_messages.h for the control socket's message types and
version. The build generates python/efdl/_names.py from them; these tests keep the package from
writing any of those names itself, and the tables from holding a name nobody uses."""

import ast
import os
import re

from efdl import _names
from efdl._names import Env, Msg

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "python", "efdl")
GENERATED = os.path.join(PACKAGE, "_names.py")


def package_sources():
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith(".py") and path != GENERATED:
                yield path


def names_of(table):
    return {k: v for k, v in vars(table).items() if not k.startswith("_")}


def docstring_nodes(tree):
    """The string constants that are docstrings (prose may name a variable)."""
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                nodes.add(id(body[0].value))
    return nodes


def env_literals(path):
    """(line, text) of each string constant in `path` that is an environment variable's name of
    the table, or looks like one of EFDL's (EFDL_ and capitals)."""
    known = set(names_of(Env).values())
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    docs = docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs
                and (node.value in known or re.fullmatch(r"EFDL_[A-Z0-9_]+", node.value))):
            found.append((node.lineno, node.value))
    return found


def header_table(*path):
    with open(os.path.join(REPO, *path)) as f:
        return dict(re.findall(r'X\(k\w+, (\w+), "([^"]+)"\)', f.read()))


def test_the_generated_module_is_the_headers_table():
    """_names.py is what the build wrote from the headers (not edited, not stale): each entry of
    EFDL_ENV_NAMES and EFDL_CONTROL_MESSAGES is there with its value, and nothing else."""
    env = header_table("src", "common", "env_names.h")
    assert env and names_of(Env) == env
    messages = header_table("src", "agent", "control_messages.h")
    assert messages and names_of(Msg) == messages
    with open(os.path.join(REPO, "src", "agent", "control_messages.h")) as f:
        version = re.search(r"kProtocolVersion = (\d+);", f.read()).group(1)
    assert _names.PROTOCOL_VERSION == int(version)


def message_type_literals(path):
    """(line, text) of each message type that `path` writes as a literal where a message's type
    is given or tested: the value of a "type" key, or a compared value (`kind == "stop"`,
    `m.get("type") in ("welcome", "stop")`). Field names that happen to equal a type ("round" as
    a key, `message.get("round")`) and a key tested for membership (`"error" in header`) are not
    message types."""
    types = set(names_of(Msg).values())
    with open(path) as f:
        tree = ast.parse(f.read(), path)

    def constants(node):
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [n for n in items if isinstance(n, ast.Constant) and n.value in types]

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "type":
                    found += constants(v)
        elif isinstance(node, ast.Compare):
            for c in node.comparators:
                found += constants(c)
            if all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                found += constants(node.left)
    return [(n.lineno, n.value) for n in found]


def test_no_module_of_the_package_writes_an_environment_variable_name_itself():
    offenders = ["%s:%d: %r" % (os.path.relpath(p, REPO), line, text)
                 for p in package_sources() for line, text in env_literals(p)]
    assert not offenders, ("write these as efdl._names.Env.<NAME> (src/common/env_names.h owns "
                           "them): " + "; ".join(offenders))


def test_no_module_of_the_package_writes_a_control_message_type_itself():
    offenders = ["%s:%d: %r" % (os.path.relpath(p, REPO), line, text)
                 for p in package_sources() for line, text in message_type_literals(p)]
    assert not offenders, ("write these as efdl._names.Msg.<TYPE> (src/agent/control_messages.h "
                           "owns them): " + "; ".join(offenders))


def test_every_name_of_the_tables_is_used():
    """A name nobody sets or reads is dead weight in the contract: each one is used as
    Env.<NAME> / Msg.<TYPE> by the package or as its C++ constant by the C++ sources."""
    python = "".join(open(p).read() for p in package_sources())
    cpp = []
    for root, _, files in os.walk(os.path.join(REPO, "src")):
        for name in files:
            if name.endswith((".cc", ".h")) and name not in ("env_names.h",
                                                             "control_messages.h"):
                with open(os.path.join(root, name)) as f:
                    cpp.append(f.read())
    cpp = "".join(cpp)
    names = ["Env." + n for n in names_of(Env)] + ["Msg." + n for n in names_of(Msg)]
    unused = [n for n in names
              if not re.search(r"\b%s\b" % re.escape(n), python)
              and not re.search(r"\b%s\b" % re.escape(_names.CPP_CONSTANTS[n]), cpp)]
    assert not unused, "names in the headers that nothing uses: %s" % unused
