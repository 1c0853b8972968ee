"""The doctor's rules for the tutorial FAQ's two symptoms: approx_kl fading toward 0 while
the reward stands still (kl_fading), and a value loss that does not fall over the first
rollouts (value_flat_early). Each fires on the sick pattern and is silent on healthy ones."""

from __future__ import annotations

from rlhflab.doctor import Doctor, DoctorConfig, diagnose

# The quickstart's PPO run (rlhflab quickstart, 20 steps, a healthy run: held-out accuracy
# rises), its first 20 logged rows: loss/value, params/approx_kl, rollout/reward_mean,
# rollout/reward_std. approx_kl jumps 30x between steps (0.0005 to 0.017).
QUICKSTART = [
    (0.083, 0.01087, 0.3516, 0.409), (0.1376, 0.003986, 0.5922, 0.4516), (0.1131, 0.004699, 0.5641, 0.4533),
    (0.1042, 0.001265, 0.5781, 0.4527), (0.09358, 0.0005239, 0.5922, 0.4516), (0.09316, 0.0018, 0.6344, 0.4455),
    (0.08254, 0.004621, 0.5906, 0.4535), (0.08403, 0.001486, 0.6344, 0.4455), (0.08028, 0.009123, 0.6344, 0.4455),
    (0.08016, 0.002402, 0.6625, 0.4392), (0.08019, 0.00212, 0.7172, 0.423), (0.07273, 0.002429, 0.6906, 0.4308),
    (0.06952, 0.003624, 0.7047, 0.4259), (0.06715, 0.0003878, 0.6625, 0.4392), (0.06585, 0.001497, 0.7594, 0.4034),
    (0.06386, 0.001872, 0.6766, 0.4352), (0.05947, 0.001576, 0.7328, 0.4144), (0.06291, 0.01679, 0.6469, 0.4447),
    (0.0613, 0.001428, 0.6625, 0.4392), (0.06131, 0.004633, 0.6344, 0.4455),
]


# The same run with ppo.kl_coeff 2.0, 100x the quickstart's (scripts/doctor_symptoms.py,
# variant kl_high): the KL penalty outweighs the reward, which stays near 0.45.
KL_HIGH = [
    (0.083, 0.01087, 0.3516, 0.409), (0.2927, 0.003929, 0.5922, 0.4516), (0.2624, 0.001895, 0.4516, 0.4426),
    (0.0942, 0.00162, 0.3391, 0.4006), (0.2658, 0.002112, 0.4937, 0.45), (0.1317, 0.002292, 0.4797, 0.448),
    (0.2395, 0.002424, 0.4094, 0.4308), (0.08313, 0.001083, 0.4375, 0.4392), (0.1226, 0.0005128, 0.4656, 0.4455),
    (0.1174, 0.001636, 0.4797, 0.448), (0.07992, 0.001001, 0.3109, 0.3843), (0.1305, 0.0009845, 0.4781, 0.4495),
    (0.09757, 0.001892, 0.3812, 0.4205), (0.091, 0.0004419, 0.4094, 0.4308), (0.159, 0.00431, 0.4094, 0.4308),
    (0.08873, 0.00113, 0.3812, 0.4205), (0.2927, 0.003636, 0.4641, 0.447), (0.1267, 0.002159, 0.45, 0.444),
    (0.07895, 0.000539, 0.5078, 0.4516), (0.08929, 0.0003362, 0.5078, 0.4516),
]


def quickstart_rows(series=QUICKSTART) -> list[dict]:
    return [{"step": i + 1, "loss/value": v, "params/approx_kl": kl, "rollout/reward_mean": r,
             "rollout/reward_std": s, "lr": 5e-5} for i, (v, kl, r, s) in enumerate(series)]


def fading_rows(n: int = 14, reward=lambda t: 0.30 + 0.01 * (t % 2), lr=lambda t: 1e-5,
                std: float = 0.4) -> list[dict]:
    # approx_kl = 0.02·0.6^t: each update moves the policy 40% less than the one before.
    return [{"step": t, "params/approx_kl": 0.02 * 0.6 ** t, "rollout/reward_mean": reward(t),
             "rollout/reward_std": std, "lr": lr(t), "loss/value": 1.0 * 0.9 ** t} for t in range(n)]


def fired(rows, rule: str) -> list[int]:
    doctor = Doctor()
    steps = []
    for row in rows:
        steps += [f.step for f in doctor.observe(row["step"], row) if f.rule == rule]
    return steps


# ------------------------------------------------------------------------ kl_fading

def test_kl_fading_fires_when_the_updates_fade_and_the_reward_stands_still():
    # At step 9 the window holds steps 0..9: median of the first 3 approx_kl 0.02·0.6 =
    # 0.012, of the last 3 0.02·0.6^8 = 3.4e-4 < 0.012 / 3 = 0.004; the reward's ends,
    # means of 3: (0.30 + 0.31 + 0.30)/3 and (0.31 + 0.30 + 0.31)/3, differ by 0.0067
    # < 0.1 · 0.4 = 0.04.
    rows = fading_rows()
    assert fired(rows, "kl_fading") == [9]  # once per stretch, not every step after
    msg = next(f.message for f in diagnose(rows).findings if f.rule == "kl_fading")
    assert "ppo.kl_coeff" in msg and "nothing is learning" in msg
    # The advice names the method's own knob.
    grpo = next(f for f in diagnose(rows, DoctorConfig(method="grpo", kl_knob="grpo.kl_coeff")).findings
                if f.rule == "kl_fading")
    assert "grpo.kl_coeff" in grpo.message


def test_kl_fading_fires_on_a_real_run_with_a_kl_weight_too_high():
    # Steps 1-10: approx_kl medians 0.003929 (steps 1-3) -> 0.001083 (steps 8-10), 3.6x
    # below, more than fade_factor 3; reward means (0.3516 + 0.5922 + 0.4516)/3 = 0.4651
    # -> (0.4375 + 0.4656 + 0.4797)/3 = 0.4609, a move of 0.004 against 0.1 x 0.44.
    assert fired(quickstart_rows(KL_HIGH), "kl_fading") == [10]


def test_kl_fading_is_silent_when_the_reward_moves():
    # The same fading updates with the reward climbing 0.3 -> 0.95: the policy got there.
    assert fired(fading_rows(reward=lambda t: 0.3 + 0.05 * t), "kl_fading") == []


def test_kl_fading_is_silent_when_the_schedule_shrinks_the_updates():
    # lr halving every 3 steps (1e-5 -> 1.25e-6 over the window): the fade is the schedule's.
    assert fired(fading_rows(lr=lambda t: 1e-5 * 0.5 ** (t // 3)), "kl_fading") == []


def test_kl_fading_is_silent_on_the_quickstart_run_and_constant_rewards():
    doctor = diagnose(quickstart_rows())
    assert "kl_fading" not in [f.rule for f in doctor.findings]
    assert doctor.state["kl_fading"] == ""  # judged, healthy
    # Every reward equal: reward_constant's finding, not this one.
    rows = fading_rows(reward=lambda t: 0.0, std=0.0)
    assert fired(rows, "kl_fading") == [] and fired(rows, "reward_constant") != []


def test_kl_fading_needs_a_full_window_and_the_reward():
    doctor = diagnose(fading_rows(n=9))
    assert doctor.state["kl_fading"] is None  # 9 < fade_window = 10 values
    rows = [{k: v for k, v in r.items() if not k.startswith("rollout/")} for r in fading_rows()]
    assert diagnose(rows).state["kl_fading"] is None


# ------------------------------------------------------------------ value_flat_early

def flat_value_rows(n: int = 8, std: float = 0.4) -> list[dict]:
    # A critic that does not learn: loss/value 0.5 ± 0.01 while the rewards vary.
    return [{"step": t, "loss/value": 0.5 + 0.01 * (-1) ** t, "rollout/reward_std": std,
             "rollout/reward_mean": 0.3 + 0.05 * t} for t in range(n)]


def test_value_flat_early_fires_on_the_eighth_rollout():
    # Means of 3: steps 0-2 (0.51 + 0.49 + 0.51)/3 = 0.5033, steps 5-7 (0.49 + 0.51 + 0.49)/3
    # = 0.4967; 0.4967 is not below 0.9 · 0.5033 = 0.453.
    rows = flat_value_rows()
    assert fired(rows, "value_flat_early") == [7]
    assert fired(rows, "value_loss") == []  # the 20-step rule has not judged yet
    msg = next(f.message for f in diagnose(rows).findings if f.rule == "value_flat_early")
    assert "first 8 rollouts" in msg and "0.503 -> 0.497" in msg


def test_value_flat_early_hands_over_to_value_loss_after_its_window():
    doctor = Doctor()
    for row in flat_value_rows(n=25):
        doctor.observe(row["step"], row)
    assert doctor.first_fired["value_flat_early"] == 7
    assert doctor.state["value_flat_early"] == ""   # cleared at 20 values ...
    assert doctor.first_fired["value_loss"] == 19   # ... where value_loss takes over


def test_value_flat_early_is_silent_on_healthy_or_rewardless_runs():
    doctor = diagnose(quickstart_rows()[:8])  # 0.111 -> 0.0866, 0.78x of the start
    assert doctor.state["value_flat_early"] == ""
    # A critic that learns: 0.9^t, means of 3 from 0.903 (steps 0-2) to 0.533 (steps 5-7), 0.59x.
    assert diagnose(fading_rows(n=8)).state["value_flat_early"] == ""
    # Rewards all equal: a flat value loss is expected (reward_constant speaks).
    assert fired(flat_value_rows(std=0.0), "value_flat_early") == []
    assert diagnose(flat_value_rows(n=7)).state["value_flat_early"] is None  # 7 < 8 rollouts
