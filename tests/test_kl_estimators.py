"""``trainer.kl_estimator`` (``workers/trainer/kl.py``): every estimator's value and gradient
against hand formulas; the straight-through "+" estimators (verl's ``k1+``, ``k3+``) keep their
estimator's value and take k2's gradient, which is the one whose expectation is the gradient of
KL(pi || pi_ref); verl's names are refused naming ours."""
import math
import re

import pytest
import torch

from workers.config_schema import build_section
from workers.trainer import TrainerConfig
from workers.trainer import config_names as trainer_config
from workers.trainer.kl import KL_ESTIMATORS

torch.set_num_threads(1)

# log(pi / pi_ref) from -30 to 30: inside k3's clamps, past its estimate's clamp at 10 (k3's
# log r = -d past ~2.53 or below ~-11), past its log-ratio's clamp at 20
D = torch.tensor([-30.0, -12.0, -2.6, -2.4, -0.7, -0.1, 0.3, 1.5, 11.5, 25.0], dtype=torch.float64)
REF = torch.linspace(-3.0, -0.5, len(D), dtype=torch.float64)


def hand_k3(d):
    """r - log r - 1, r = pi_ref / pi = exp(-d), with verl's low_var_kl clamps, in plain floats."""
    log_r = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(log_r) - log_r - 1.0, -10.0), 10.0)


def hand_k3_grad(d):
    """d k3 / d logp: (1 - r) inside both clamps, 0 past either."""
    log_r = -d
    if abs(log_r) > 20.0 or math.exp(log_r) - log_r - 1.0 > 10.0:
        return 0.0
    return 1.0 - math.exp(log_r)


HAND = {  # name -> (value of d = logp - ref, d value / d logp)
    "k1": (lambda d: d, lambda d: 1.0),
    "k2": (lambda d: 0.5 * d * d, lambda d: d),
    "k3": (hand_k3, hand_k3_grad),
    "abs": (abs, lambda d: 1.0 if d > 0 else -1.0),
}
HAND.update({f"{name}+": (HAND[name][0], HAND["k2"][1]) for name in ("k1", "k3", "abs")})


def value_and_grad(name):
    logp = (REF + D).requires_grad_()
    value = KL_ESTIMATORS[name](logp, REF)  # [N]
    value.sum().backward()
    return value.detach(), logp.grad


@pytest.mark.parametrize("name", sorted(HAND))
def test_value_and_gradient_match_the_hand_formulas(name):
    value, grad = value_and_grad(name)
    want_value, want_grad = HAND[name]
    assert value.tolist() == pytest.approx([want_value(d) for d in D.tolist()], rel=1e-12, abs=1e-12)
    assert grad.tolist() == pytest.approx([want_grad(d) for d in D.tolist()], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", ["k1", "k3", "abs"])
def test_straight_through_has_the_value_of_its_estimator_and_the_gradient_of_k2(name):
    value, grad = value_and_grad(f"{name}+")
    base_value, base_grad = value_and_grad(name)
    _, k2_grad = value_and_grad("k2")
    assert torch.equal(value, base_value)  # bit for bit: k2 - k2 is exactly 0
    assert torch.equal(grad, k2_grad)
    assert not torch.equal(grad, base_grad)
    if name == "k3":  # past k3's clamp a token has k3's constant 10 and still k2's gradient
        past = value == 10.0
        assert past.any() and (base_grad[past] == 0).all() and (grad[past] == D[past]).all()


def expected_gradient(name, p_logits, q_logp):
    """sum_x p(x) d/d theta est(log p_theta(x), log q(x)), p = softmax(theta): the expected
    gradient the loss takes from tokens sampled from p (the sample's probability not
    differentiated: it is the rollout's)."""
    theta = p_logits.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    weights = logp.detach().exp()
    (weights * KL_ESTIMATORS[name](logp, q_logp)).sum().backward()
    return theta.grad


def test_k2_and_the_straight_through_estimators_have_the_kl_gradient_in_expectation():
    """Why the "+" estimators (Schulman's note; verl PR 2953): E_p[grad k2] is the gradient of
    KL(p || q); k1's is 0 (E_p[grad log p] = 0) and k3's another vector."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(6, generator=g, dtype=torch.float64)
    q_logp = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    theta = p_logits.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    (logp.exp() * (logp - q_logp)).sum().backward()  # exact KL(p || q)
    exact = theta.grad
    assert exact.abs().max() > 0.05
    for name in ("k2", "k1+", "k3+", "abs+"):
        assert torch.allclose(expected_gradient(name, p_logits, q_logp), exact, atol=1e-12), name
    assert expected_gradient("k1", p_logits, q_logp).abs().max() < 1e-12
    assert (expected_gradient("k3", p_logits, q_logp) - exact).abs().max() > 0.01


def test_the_config_takes_every_estimator_and_refuses_verls_names_naming_ours():
    assert trainer_config.KL_ESTIMATORS == tuple(KL_ESTIMATORS)
    for name in KL_ESTIMATORS:
        assert TrainerConfig(kl_estimator=name).kl_estimator == name
    for verl, ours in (("mse", "k2"), ("kl", "k1"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+"), ("kl+", "k1+"),
                       ("mse+", "k2")):
        with pytest.raises(ValueError, match=rf"^trainer.kl_estimator: {re.escape(repr(verl))} is verl's name; "
                                             rf"here it is {re.escape(repr(ours))}"):
            TrainerConfig(kl_estimator=verl)
    for other in ("full", "k2+", "k4"):
        with pytest.raises(ValueError, match=rf"trainer.kl_estimator: {re.escape(repr(other))} is not one of"):
            TrainerConfig(kl_estimator=other)
    assert build_section(TrainerConfig, "trainer", {"kl_estimator": "k3+", "kl_coef": 0.1}).kl_estimator == "k3+"
