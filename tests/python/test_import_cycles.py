"""No import cycle among the efdl package's modules (#31).

A static check: every import statement of python/efdl (at module level or inside a function,
where the package's lazy imports are) and every importlib.import_module("efdl....") with a
literal name is an edge from the importing module to the module it names (`from pkg import x`:
pkg.x when x is a submodule, else pkg); a cycle is a strongly connected component of more than
one module. Parent packages a dotted import also runs are not edges: the package __init__s only
import downwards or lazily.
"""

import ast
import os
import subprocess

from conftest import PYTHON, PYTHON_DIR

PACKAGE = os.path.join(PYTHON_DIR, "efdl")


def _modules():
    """{module name: path} of every module of the package (.py files; compiled extensions, as
    efdl._efdl, by name with path None: they import nothing of efdl)."""
    out = {}
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".so"):
                rel = os.path.relpath(os.path.join(root, f.split(".")[0]), PYTHON_DIR)
                out[".".join(rel.split(os.sep))] = None
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, f), PYTHON_DIR)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(root, f)
    out.setdefault("efdl._efdl", None)   # the compiled core, whether built into python/ or not
    return out


def _resolve(importer, is_package, level, module):
    if not level:
        return module
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name, path, modules):
    """The efdl modules that module `name` (at `path`) imports."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_package = path.endswith("__init__.py")
    out = set()

    def add(target):
        # The longest known module prefix of `target` (a name imported from a module is not one).
        parts = target.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            out.add(".".join(parts))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                add(base + "." + alias.name if base + "." + alias.name in modules else base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value)
    out.discard(name)
    return out


def _cycles(graph):
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph():
    modules = _modules()
    return {name: _imports(name, path, modules) if path else set()
            for name, path in modules.items()}


def test_the_graph_sees_lazy_imports_of_every_form():
    # The check can only find cycles through edges it sees: these are imports inside functions,
    # relative to the package and through importlib (python/efdl has each form).
    graph = import_graph()
    assert "efdl._progress" in graph["efdl"]                        # inside a function
    assert "efdl.backend.torch.elastic" in graph["efdl.backend.torch"]
    assert "efdl.backend.horovod.torch.elastic" in \
        graph["efdl.backend.horovod.torch._layer"]                  # importlib.import_module
    assert "efdl.state" in graph["efdl.backend.horovod.torch.elastic"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_efdl_modules():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles among efdl's modules (separated by ';'): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


def test_the_horovod_layer_and_its_elastic_api_import_in_either_order():
    # At run time too, in fresh interpreters: hvd.elastic and its exceptions reachable whichever
    # of the two modules comes first.
    orders = (("efdl.backend.horovod.torch._layer", "efdl.backend.horovod.torch.elastic"),
              ("efdl.backend.horovod.torch.elastic", "efdl.backend.horovod.torch._layer"))
    code = ("import importlib, sys\n"
            "first, second = [importlib.import_module(m) for m in sys.argv[1:]]\n"
            "layer = sys.modules['efdl.backend.horovod.torch._layer']\n"
            "elastic = sys.modules['efdl.backend.horovod.torch.elastic']\n"
            "assert layer.elastic is elastic\n"
            "assert layer.HostsUpdatedInterrupt is elastic.HostsUpdatedInterrupt\n"
            "assert layer.HorovodInternalError is elastic.HorovodInternalError\n"
            "assert callable(elastic.run) and elastic.TorchState.commit\n")
    env = dict(os.environ, EFDL_HOROVOD="torch")
    for order in orders:
        proc = subprocess.run([PYTHON, "-c", code, *order], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, (order, proc.stderr[-2000:])
