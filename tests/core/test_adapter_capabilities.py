"""Optional adapter capabilities: declared by each adapter, queried by name, passed on by wrappers."""

from __future__ import annotations

import pytest

from broker.core.adapter import (
    ADAPTERS,
    CAPABILITIES,
    BatchSubmitter,
    ChangeNotifier,
    Closable,
    LogReader,
    MigPublisher,
    NodeConfigurer,
    NodeFencer,
    Preemptor,
    Scaler,
    TenantQuotaKeeper,
    TimesliceConfigurator,
    adapter_class,
    capability,
    declared,
    submit_batch,
    supports,
    undeclared_or_missing,
)
from broker.core.metrics import instrument


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_every_adapter_declares_exactly_the_capabilities_it_has(kind):
    assert undeclared_or_missing(adapter_class(kind)) == []


def test_the_real_adapters_declare_what_the_broker_uses():
    assert declared(adapter_class("slurm")) == {BatchSubmitter, LogReader, MigPublisher, NodeFencer, Preemptor}
    # A Slurm cluster takes MIG layouts from gpush only where its config says which files to rewrite.
    plain = adapter_class("slurm")("s", {"slurm_conf": "/etc/slurm/slurm.conf"})
    assert MigPublisher not in declared(plain) and NodeFencer in declared(plain)
    mig = adapter_class("slurm")("s", {"slurm_conf": "/x/slurm.conf", "mig_gres_conf": "/x/gres.conf"})
    assert MigPublisher in declared(mig) and MigPublisher in declared(instrument(mig, "s", "slurm"))
    assert declared(adapter_class("k8s")) == {
        BatchSubmitter,
        Scaler,
        TimesliceConfigurator,
        Closable,
        LogReader,
        ChangeNotifier,
        TenantQuotaKeeper,
        Preemptor,
        NodeFencer,
        MigPublisher,
        NodeConfigurer,
    }
    assert declared(adapter_class("sim")) == frozenset({LogReader, MigPublisher, NodeFencer, Preemptor, Scaler})


class Plain:
    """The protocol alone."""

    name = "plain"

    def __init__(self):
        self.submitted = []

    def submit(self, job_id, spec, placement, owner=None):
        self.submitted.append(job_id)
        return f"plain-{job_id}"

    def cancel(self, job_id):
        pass

    def find(self, job_id):
        return None

    def statuses(self, cursor=None):
        raise NotImplementedError

    def inventory(self):
        return []

    def health(self):
        raise NotImplementedError


class Scaling(Plain):
    capabilities = frozenset({Scaler, Closable})

    def __init__(self):
        super().__init__()
        self.scaled, self.closed = [], False

    def scale(self, job_id, replicas):
        self.scaled.append((job_id, replicas))
        return replicas

    def close(self):
        self.closed = True


class Undeclared(Plain):
    """Has a ``scale`` (for some other purpose) but promises nothing."""

    def scale(self, job_id, replicas):
        raise AssertionError("never called: not declared")


def test_a_capability_counts_only_when_declared():
    assert capability(Scaling(), Scaler) is not None
    assert capability(Undeclared(), Scaler) is None
    assert undeclared_or_missing(Undeclared) == ["Undeclared has scale but does not declare Scaler"]
    assert capability(Plain(), Closable) is None
    with pytest.raises(ValueError, match="not an adapter capability"):
        supports(Plain(), Plain)


def test_a_declaration_without_its_methods_is_caught():
    class Liar(Plain):
        capabilities = frozenset({TimesliceConfigurator})

        def timeslice(self, replicas, node_label=None):
            return None

    assert undeclared_or_missing(Liar) == ["Liar declares TimesliceConfigurator but has no apply_timeslice"]


def test_the_metrics_wrapper_offers_exactly_what_the_adapter_declares():
    plain, scaling = instrument(Plain(), "a", "sim"), instrument(Scaling(), "b", "k8s")
    for wrapper, inner in ((plain, plain.adapter), (scaling, scaling.adapter)):
        assert declared(wrapper) == declared(inner)
        for protocol, methods in CAPABILITIES.items():
            assert supports(wrapper, protocol) == supports(inner, protocol)
            assert all(hasattr(wrapper, m) == (protocol in declared(inner)) for m in methods)
    assert capability(scaling, Scaler).scale(7, 3) == 3 and scaling.adapter.scaled == [(7, 3)]
    capability(scaling, Closable).close()
    assert scaling.adapter.closed
    assert plain.name == "plain" and instrument(plain, "a", "sim") is plain


def test_a_batch_goes_one_by_one_to_an_adapter_without_submit_many():
    adapter = Plain()
    assert submit_batch(instrument(adapter, "a", "sim"), [(1, None, None), (2, None, None)]) == ["plain-1", "plain-2"]
    assert adapter.submitted == [1, 2]
