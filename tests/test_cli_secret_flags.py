"""One shape for Secret flags: --mlflow-secret NAME is always a Secret with keys uri, username and
password; --store-secret NAME always the data store's keys. The old spellings still parse to the
same settings and say their new name in one line."""

from __future__ import annotations

import pytest

from elastic_step.cli import build_parser


def parsed(*argv: str):
    return build_parser().parse_args(list(argv))


TRAIN = ("train", "--model-def", "m", "--data", "d", "--job-dir", "j")
SUBMIT = ("submit", "--job-name", "digits", "--image", "img:1", "--model-def", "m", "--data", "s3://bucket/d")


@pytest.mark.parametrize("argv,dest", [
    (TRAIN, "worker_store_secret"),
    (SUBMIT, "store_secret"),
    (("argo", "render", "--pipeline", "all", "--out", "o"), "store_secret"),
])
def test_store_secret_is_one_flag_and_the_old_name_still_works(capsys, argv, dest):
    assert getattr(parsed(*argv, "--store-secret", "data-reader"), dest) == "data-reader"
    assert capsys.readouterr().err == ""
    if argv is not TRAIN and argv is not SUBMIT:
        return  # argo render never had another name for it
    assert getattr(parsed(*argv, "--worker-store-secret", "data-reader"), dest) == "data-reader"
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "--worker-store-secret is deprecated, use --store-secret" in said


def test_the_default_of_a_renamed_flag_is_kept():
    assert parsed(*TRAIN).worker_store_secret is None and parsed(*SUBMIT).store_secret is None


def test_submit_takes_the_mlflow_uri_from_the_secret_unless_one_is_given():
    from elastic_step.cli.submit import submission
    from elastic_step.submit.spec import master_env

    def env(*flags: str) -> dict:
        sub = submission(parsed(*SUBMIT, "--namespace", "ml", "--mlflow-secret", "mlflow-credentials", *flags))
        return {e.name: (e.value or (e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key))
                for e in master_env(sub) if e.name.startswith("MLFLOW_")}

    assert env() == {"MLFLOW_TRACKING_URI": ("mlflow-credentials", "uri"),
                     "MLFLOW_TRACKING_USERNAME": ("mlflow-credentials", "username"),
                     "MLFLOW_TRACKING_PASSWORD": ("mlflow-credentials", "password")}
    assert env("--mlflow-uri", "http://mlflow.ml:5000")["MLFLOW_TRACKING_URI"] == "http://mlflow.ml:5000"
