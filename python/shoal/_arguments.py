"""Wrong argument types as shoal's one line (docs/python.md, "Errors").

pybind11 answers a call whose arguments match none of a function's signatures with a TypeError of
several lines (every signature, then the values given). shoal's functions and methods are wrapped
here so that such a call raises ArgumentTypeError instead, a shoal.UsageError that is also a
TypeError, with one line: the function's public name, the types given and the ones expected. Any
other error, a TypeError raised inside the call included, leaves as it came. Operators too
(`GlobalTensor @ torch.Tensor`): pybind11 binds them as methods that raise the same several
lines."""
import functools
import numbers
import re

from . import _C

_PYBIND_TYPE_ERROR = re.compile(r"^\S+\(\): incompatible (?:function|constructor) arguments")
_SIGNATURE = re.compile(r"^\s*\d+\. (?:[\w.]+)?(\(.*\))(?: -> .*)?$")


class ArgumentTypeError(_C.UsageError, TypeError):
    """A call to shoal with arguments of types it does not take."""


def _short(text):
    for long, short in (("torch._C._te.ScalarType", "torch.dtype"), ("shoal._C.global_.nn.", ""),
                        ("shoal._C.global_.", ""), ("shoal._C.", ""), ("torch.Tensor", "Tensor")):
        text = text.replace(long, short)
    return text


def _type_name(value):
    kind = type(value)
    return kind.__name__ if kind.__module__ in ("builtins", "torch") else _short(kind.__module__ + "." + kind.__name__)


_SCALARS = {"int": (numbers.Integral, "an int"), "float": (numbers.Real, "a float"), "bool": (bool, "a bool"),
            "str": (str, "a str")}


def _parameters(signature):
    """[(name, type)] of a pybind11 signature "(a: int, b: List[int] = None)"."""
    parts, depth, start, body = [], 0, 0, signature[1:-1]
    for i, c in enumerate(body + ","):
        depth += c in "[(" and 1 or c in "])" and -1 or 0
        if c == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    found = []
    for part in parts:
        name, _, kind = part.partition(": ")
        found.append((name, kind.split(" = ")[0]))
    return found


def _culprit(signature, args, kwargs):
    """'name is a T; expected an int' for the first argument whose plain type (int, float, bool,
    str) the value is not of; None when every such argument fits (then the types are compared
    whole: a class may convert from another, as Placement from a list)."""
    parameters = _parameters(signature)
    given = list(zip([n for n, _ in parameters], args)) + list(kwargs.items())
    kinds = dict(parameters)
    for name, value in given:
        scalar = _SCALARS.get(kinds.get(name))
        if scalar and not (isinstance(value, scalar[0]) and (scalar[0] is bool or not isinstance(value, bool))):
            return "%s is a %s; expected %s" % (name, _type_name(value), scalar[1])
    return None


def _one_line(name, message, args, kwargs, method):
    expected = []
    for line in message.splitlines():
        match = _SIGNATURE.match(line)
        if match:
            signature = _short(match.group(1))
            if method:  # pybind names the instance first: `self: GlobalTensor, ` is not the caller's to give
                signature = re.sub(r"^\(self(?:: [^,)]*)?(?:, )?", "(", signature)
            expected.append(signature)
    args = args[1:] if method else args
    if len(expected) == 1:
        culprit = _culprit(expected[0], args, kwargs)
        if culprit:
            return "%s: %s" % (name, culprit)
    given = [_type_name(a) for a in args] + ["%s=%s" % (k, _type_name(v)) for k, v in kwargs.items()]
    return "%s: arguments of types (%s); expected %s" % (name, ", ".join(given), " or ".join(expected) or "others")


def _wrap(function, name, method=False):
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except TypeError as error:
            if type(error) is not TypeError or not _PYBIND_TYPE_ERROR.match(str(error)):
                raise
            message = _one_line(name, str(error), args, kwargs, method)
        raise ArgumentTypeError(message) from None

    return call


def _is_pybind(value):
    return type(value).__name__ == "builtin_function_or_method"


# The classes of _C that shoal's own Python classes are made over, by those classes' names: the
# keyword arguments the program gave pass through to them unchanged.
_BEHIND = {"Replication": "shoal.DataParallel", "Sampler": "shoal.data.Sampler", "ElasticState": "shoal.elastic.State",
           "PsEmbedding": "shoal.ps.Embedding", "PsOptimizer": "shoal.ps.Optimizer",
           "OptimizerMirror": "shoal._C.OptimizerMirror", "GradientSync": "shoal.global_.nn.GradientSync",
           "Pipeline": "shoal.pipeline.Pipeline", "SyntheticCtr": "shoal.datasets.SyntheticCtr"}
_COMM = {"Group", "ReduceOp", "Work", "world"}


def wrap_all():
    """Wraps every function and method of shoal._C, each named as the package shows it."""
    wrap_module(_C, "shoal")
    wrap_module(_C.global_, "shoal.global_")
    wrap_module(_C.global_.nn, "shoal._C.global_.nn")
    wrap_module(_C.pipeline, "shoal.pipeline")


def wrap_module(module, public):
    """Wraps `module`'s functions and its classes' methods, named under `public`."""
    for attr, value in list(vars(module).items()):
        if attr.startswith("__"):
            continue
        in_comm = attr in _COMM and public == "shoal"
        name = _BEHIND.get(attr) or ("shoal.comm." if in_comm else public + ".") + attr
        if _is_pybind(value):
            setattr(module, attr, _wrap(value, name))
        elif isinstance(value, type) and value.__module__ == module.__name__ and not issubclass(value, BaseException):
            _wrap_class(value, name, only_init=attr in _BEHIND and attr != "SyntheticCtr")


def _wrap_class(cls, public, only_init=False):
    """Wraps the methods of `cls`. Of a class that shoal's own Python class is made over (but
    SyntheticCtr, which the program holds itself), only the constructor, which takes the
    program's arguments: its other methods are called by shoal's Python code, some once a step
    (DataParallel's count before each forward), and take no wrapper."""
    for attr, value in list(vars(cls).items()):
        if only_init and attr != "__init__":
            continue
        if isinstance(value, staticmethod) and _is_pybind(value.__func__):
            setattr(cls, attr, staticmethod(_wrap(value.__func__, "%s.%s" % (public, attr))))
        elif type(value).__name__ == "instancemethod" and _is_pybind(value.__func__):
            name = public if attr == "__init__" else "%s.%s" % (public, attr)
            setattr(cls, attr, _wrap(value.__func__, name, method=True))
