"""Python source that makes the optimiser's optional packages unimportable, for tests of a machine without them
(a GPU node that only runs saved plans). Run it first in a subprocess, or as that process's sitecustomize."""
OPTIONAL_ABSENT = '''
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"egglog", "islpy", "ortools", "graphviz"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
'''
