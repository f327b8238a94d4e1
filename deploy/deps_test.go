package deploy

// Modules the coming tests use, kept in go.mod until they import them.
import (
	_ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	_ "helm.sh/helm/v3/pkg/chart/loader"
	_ "helm.sh/helm/v3/pkg/chartutil"
	_ "helm.sh/helm/v3/pkg/engine"
	_ "k8s.io/api/apps/v1"
	_ "k8s.io/apimachinery/pkg/util/yaml"
)
