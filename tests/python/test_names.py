"""The names C++ and Python share have one owner (issue #31): src/common/env_names.h for the
environment variables, src/agent/control_messages.h for the control socket's message types. The
build generates python/efdl/_names.py from them; these tests keep the package from writing any of
those names itself, and the tables from holding a name nobody uses."""

import ast
import os
import re

from efdl import _names
from efdl._names import Env

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


def test_the_generated_module_is_the_headers_table():
    """_names.py is what the build wrote from the headers (not edited, not stale): each entry of
    EFDL_ENV_NAMES is there with its value, and nothing else."""
    with open(os.path.join(REPO, "src", "common", "env_names.h")) as f:
        header = dict(re.findall(r'X\(k\w+, (\w+), "([^"]+)"\)', f.read()))
    assert header and names_of(Env) == header


def test_no_module_of_the_package_writes_an_environment_variable_name_itself():
    offenders = ["%s:%d: %r" % (os.path.relpath(p, REPO), line, text)
                 for p in package_sources() for line, text in env_literals(p)]
    assert not offenders, ("write these as efdl._names.Env.<NAME> (src/common/env_names.h owns "
                           "them): " + "; ".join(offenders))


def test_every_name_of_the_table_is_used():
    """A name nobody sets or reads is dead weight in the contract: each one is used as
    Env.<NAME> by the package or as its envvar:: constant by the C++ sources."""
    python = "".join(open(p).read() for p in package_sources())
    cpp = []
    for root, _, files in os.walk(os.path.join(REPO, "src")):
        for name in files:
            if name.endswith((".cc", ".h")) and name != "env_names.h":
                with open(os.path.join(root, name)) as f:
                    cpp.append(f.read())
    cpp = "".join(cpp)
    unused = [n for n in names_of(Env)
              if not re.search(r"\bEnv\.%s\b" % n, python)
              and not re.search(r"\b%s\b" % re.escape(_names.CPP_CONSTANTS["Env." + n]), cpp)]
    assert not unused, "names in src/common/env_names.h that nothing uses: %s" % unused
