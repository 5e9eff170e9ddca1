"""The operator's triggers (operator/handlers.py): a model that found an object of an earlier model of its
name in its way (deleted, then made again: the garbage collector deletes that object) is looked at again, as
no later event may bring it back; a conflict with any other owner is left to the Conflict condition."""

from __future__ import annotations

import pytest

from neuronfleet.operator import handlers


def conflict(message: str, status: str = "True") -> dict:
    return {
        "conditions": [{"type": "Conflict", "status": status, "reason": "OwnedElsewhere", "message": message}]
    }


@pytest.mark.parametrize(
    ("status", "again"),
    [
        (
            conflict(
                "Deployment m-unified is controlled by NeuronModel m (uid 4f63c8b3); it is left as it is"
            ),
            True,
        ),
        (
            conflict("Deployment m-unified is controlled by NeuronModel other (uid 1); it is left as it is"),
            False,
        ),
        (conflict("Service m is controlled by Service-owner x (uid 2); it is left as it is"), False),
        (
            conflict("Deployment m-unified is controlled by NeuronModel m (uid 4f63c8b3)", status="False"),
            False,
        ),
        ({"conditions": [{"type": "Ready", "status": "True"}]}, False),
        ({}, False),
    ],
)
def test_a_model_in_the_way_of_an_earlier_one_of_its_name_is_looked_at_again(status, again):
    assert handlers._left_by_an_earlier_model(("ns", "m"), status) is again
