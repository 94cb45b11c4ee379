"""KFP v2 components for the training lifecycle, each a thin shell over one engine function.

    from elastic_step.components import prepare_data, train_elastic, evaluate_model, export_model, promote_model, deploy_model
"""

from elastic_step.components.deploy_model.component import deploy_model
from elastic_step.components.evaluate_model.component import evaluate_model
from elastic_step.components.export_model.component import export_model
from elastic_step.components.prepare_data.component import prepare_data
from elastic_step.components.promote_model.component import promote_model
from elastic_step.components.train_elastic.component import train_elastic

__all__ = ["prepare_data", "train_elastic", "evaluate_model", "export_model", "promote_model", "deploy_model"]
