package deploy

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

const chartDir = "helm/kvgate"

// rendered is one `helm template` of the chart: its manifests decoded
// into the Kubernetes API types.
type rendered struct {
	deploy   *appsv1.Deployment
	service  *corev1.Service
	config   *corev1.ConfigMap
	account  *corev1.ServiceAccount
	pdb      *policyv1.PodDisruptionBudget
	netpol   *networkingv1.NetworkPolicy
	monitor  *monitoringv1.ServiceMonitor
	scaled   map[string]any // KEDA's ScaledObject, checked against its schema
	manifest map[string]string
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load %s: %v", chartDir, err)
	}
	return c
}

// helmTemplate renders the chart as `helm template kvgate ... -f values`
// does, with helm's own loader, value coalescing and engine.
func helmTemplate(t *testing.T, c *chart.Chart, values map[string]any) (map[string]string, error) {
	t.Helper()
	vals, err := chartutil.ToRenderValues(c, values, chartutil.ReleaseOptions{
		Name: "kvgate", Namespace: "inference", Revision: 1, IsInstall: true,
	}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	return engine.Render(c, vals)
}

func readValues(t *testing.T, file string) map[string]any {
	t.Helper()
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	v, err := chartutil.ReadValues(raw)
	if err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	return v
}

// strict decodes YAML into a typed object, refusing fields the type does
// not have.
func strict(t *testing.T, name string, doc []byte, into any) {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, into); err != nil {
		t.Errorf("%s: %v\n%s", name, err, doc)
	}
}

func render(t *testing.T, c *chart.Chart, values map[string]any) rendered {
	t.Helper()
	files, err := helmTemplate(t, c, values)
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	r := rendered{manifest: files}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		if strings.HasSuffix(name, "NOTES.txt") {
			continue
		}
		for i, doc := range bytes.Split([]byte(files[name]), []byte("\n---")) {
			if len(bytes.TrimSpace(doc)) == 0 {
				continue
			}
			where := fmt.Sprintf("%s#%d", name, i)
			var head struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
			}
			if err := yaml.Unmarshal(doc, &head); err != nil {
				t.Errorf("%s: %v\n%s", where, err, doc)
				continue
			}
			switch head.APIVersion + " " + head.Kind {
			case "apps/v1 Deployment":
				r.deploy = &appsv1.Deployment{}
				strict(t, where, doc, r.deploy)
			case "v1 Service":
				r.service = &corev1.Service{}
				strict(t, where, doc, r.service)
			case "v1 ConfigMap":
				r.config = &corev1.ConfigMap{}
				strict(t, where, doc, r.config)
			case "v1 ServiceAccount":
				r.account = &corev1.ServiceAccount{}
				strict(t, where, doc, r.account)
			case "policy/v1 PodDisruptionBudget":
				r.pdb = &policyv1.PodDisruptionBudget{}
				strict(t, where, doc, r.pdb)
			case "networking.k8s.io/v1 NetworkPolicy":
				r.netpol = &networkingv1.NetworkPolicy{}
				strict(t, where, doc, r.netpol)
			case "monitoring.coreos.com/v1 ServiceMonitor":
				r.monitor = &monitoringv1.ServiceMonitor{}
				strict(t, where, doc, r.monitor)
			case "keda.sh/v1alpha1 ScaledObject":
				if err := yaml.Unmarshal(doc, &r.scaled); err != nil {
					t.Errorf("%s: %v", where, err)
				}
				for _, e := range checkScaledObject(r.scaled) {
					t.Errorf("%s: %s", where, e)
				}
			default:
				t.Errorf("%s: unexpected %s %s", where, head.APIVersion, head.Kind)
			}
		}
	}
	return r
}

// TestHelmTemplate renders the chart for each values file in ci/ and
// checks every manifest, decoded strictly into the Kubernetes API types.
func TestHelmTemplate(t *testing.T) {
	c := loadChart(t)
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	if err != nil || len(files) < 3 {
		t.Fatalf("values files in %s/ci: %v %v, want at least 3", chartDir, files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			vals := readValues(t, f)
			r := render(t, c, vals)
			checkRendered(t, c, vals, r)
		})
	}
}

func checkRendered(t *testing.T, c *chart.Chart, vals map[string]any, r rendered) {
	if r.deploy == nil || r.service == nil || r.config == nil {
		t.Fatalf("want a Deployment, a Service and a ConfigMap; got %v", mapsKeys(r.manifest))
	}
	merged, err := chartutil.CoalesceValues(c, vals)
	if err != nil {
		t.Fatal(err)
	}
	d := r.deploy
	wantReplicas, _ := merged["replicaCount"].(float64)
	if d.Spec.Replicas == nil || float64(*d.Spec.Replicas) != wantReplicas {
		t.Errorf("replicas %v, want %v", d.Spec.Replicas, wantReplicas)
	}
	pod := d.Spec.Template
	sel, err := metaSelector(d.Spec.Selector.MatchLabels)
	if err != nil || !sel.Matches(labels.Set(pod.Labels)) {
		t.Errorf("the Deployment's selector %v does not match its pods' labels %v", d.Spec.Selector.MatchLabels, pod.Labels)
	}
	if len(pod.Spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(pod.Spec.Containers))
	}
	ctr := pod.Spec.Containers[0]

	// Probes on /healthz (liveness, startup) and /readyz (readiness), on
	// the container's port.
	for what, p := range map[string]*corev1.Probe{"liveness": ctr.LivenessProbe, "readiness": ctr.ReadinessProbe, "startup": ctr.StartupProbe} {
		want := "/healthz"
		if what == "readiness" {
			want = "/readyz"
		}
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != want || p.HTTPGet.Port.String() != "http" {
			t.Errorf("%s probe %+v, want GET %s on port http", what, p, want)
		}
	}
	if !slices.ContainsFunc(ctr.Ports, func(p corev1.ContainerPort) bool { return p.Name == "http" }) {
		t.Errorf("container ports %v have no http", ctr.Ports)
	}
	if ctr.Resources.Requests.Cpu().IsZero() || ctr.Resources.Requests.Memory().IsZero() || ctr.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %v: want CPU and memory requests and a memory limit", ctr.Resources)
	}
	psc, csc := pod.Spec.SecurityContext, ctr.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		t.Errorf("pod securityContext %+v: want runAsNonRoot and a non-zero runAsUser", psc)
	}
	if csc == nil || csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation || csc.ReadOnlyRootFilesystem == nil ||
		!*csc.ReadOnlyRootFilesystem || csc.Capabilities == nil || !slices.Contains(csc.Capabilities.Drop, "ALL") {
		t.Errorf("container securityContext %+v: want no privilege escalation, a read-only root and ALL capabilities dropped", csc)
	}

	// The ConfigMap's kvgate.yaml: what kvgate reads, with a drain shorter
	// than the pod's grace period.
	cfgText := r.config.Data["kvgate.yaml"]
	var kcfg struct {
		DrainTimeout string `json:"drain_timeout"`
		Addr         string `json:"addr"`
	}
	if err := yaml.Unmarshal([]byte(cfgText), &kcfg); err != nil {
		t.Fatalf("kvgate.yaml in the ConfigMap: %v\n%s", err, cfgText)
	}
	drain, err := time.ParseDuration(kcfg.DrainTimeout)
	if err != nil {
		t.Fatalf("drain_timeout %q: %v", kcfg.DrainTimeout, err)
	}
	grace := pod.Spec.TerminationGracePeriodSeconds
	if grace == nil || time.Duration(*grace)*time.Second <= drain {
		t.Errorf("terminationGracePeriodSeconds %v, want longer than drain_timeout %s", grace, drain)
	}
	// With the container's plain variables (the NATS URL among them),
	// as serve reads them; the secrets' are not here.
	var plain []string
	for _, e := range ctr.Env {
		if e.ValueFrom == nil {
			plain = append(plain, e.Name+"="+e.Value)
		}
	}
	checkKvgateConfig(t, cfgText, plain...)
	if !slices.ContainsFunc(pod.Spec.Volumes, func(v corev1.Volume) bool {
		return v.ConfigMap != nil && v.ConfigMap.Name == r.config.Name
	}) {
		t.Errorf("no volume mounts the ConfigMap %s", r.config.Name)
	}
	if !slices.Contains(ctr.Args, "/etc/kvgate/kvgate.yaml") {
		t.Errorf("args %q do not name the mounted kvgate.yaml", ctr.Args)
	}

	// Secrets by reference, never in the ConfigMap.
	env := map[string]corev1.EnvVar{}
	for _, e := range ctr.Env {
		env[e.Name] = e
	}
	// kvgate listens on the container's port: the address it takes is the
	// container's KVGATE_ADDR, else the image's, else the file's (its
	// environment beats its file).
	listen := kcfg.Addr
	if v := imageEnv(t)["KVGATE_ADDR"]; v != "" {
		listen = v
	}
	if v := env["KVGATE_ADDR"].Value; v != "" {
		listen = v
	}
	if port := ctr.Ports[slices.IndexFunc(ctr.Ports, func(p corev1.ContainerPort) bool { return p.Name == "http" })].ContainerPort; !strings.HasSuffix(listen, fmt.Sprintf(":%d", port)) {
		t.Errorf("kvgate listens on %q (file %q, image and container environment), the container's http port is %d", listen, kcfg.Addr, port)
	}
	secrets := obj(merged["secrets"])
	if ref := env["KVGATE_STORE"].ValueFrom; ref == nil || ref.SecretKeyRef == nil || ref.SecretKeyRef.Name != obj(secrets["databaseURL"])["name"] {
		t.Errorf("KVGATE_STORE %+v: want the databaseURL Secret's key", env["KVGATE_STORE"])
	}
	if name := obj(secrets["adminKey"])["name"]; name != "" {
		if ref := env["KVGATE_ADMIN_KEY"].ValueFrom; ref == nil || ref.SecretKeyRef == nil || ref.SecretKeyRef.Name != name {
			t.Errorf("KVGATE_ADMIN_KEY %+v: want Secret %v", env["KVGATE_ADMIN_KEY"], name)
		}
	} else if _, ok := env["KVGATE_ADMIN_KEY"]; ok {
		t.Error("KVGATE_ADMIN_KEY set with no adminKey Secret named")
	}
	if name := obj(secrets["env"])["name"]; name != "" {
		if !slices.ContainsFunc(ctr.EnvFrom, func(e corev1.EnvFromSource) bool { return e.SecretRef != nil && e.SecretRef.Name == name }) {
			t.Errorf("envFrom %+v: want Secret %v", ctr.EnvFrom, name)
		}
	}
	for _, e := range ctr.Env {
		if e.Value != "" && (strings.Contains(e.Value, "postgres://") || strings.Contains(strings.ToLower(e.Name), "key")) {
			t.Errorf("env %s carries a secret in clear: %q", e.Name, e.Value)
		}
	}

	// The Service reaches the pods on the container's port.
	ssel, _ := metaSelector(r.service.Spec.Selector)
	if !ssel.Matches(labels.Set(pod.Labels)) || len(r.service.Spec.Ports) == 0 || r.service.Spec.Ports[0].TargetPort.String() != "http" {
		t.Errorf("Service %+v does not reach the pods' http port", r.service.Spec)
	}
	if sa := pod.Spec.ServiceAccountName; r.account != nil && r.account.Name != sa {
		t.Errorf("pods use service account %q, the chart creates %q", sa, r.account.Name)
	}

	optional := func(key string) bool { b, _ := obj(merged[key])["enabled"].(bool); return b }
	wantPDB := optional("podDisruptionBudget") && wantReplicas > 1 // one replica: a PDB would block node drains
	if (r.pdb != nil) != wantPDB {
		t.Errorf("PodDisruptionBudget rendered %v, want %v (enabled %v, %v replicas)", r.pdb != nil, wantPDB, optional("podDisruptionBudget"), wantReplicas)
	} else if r.pdb != nil {
		psel, _ := metaSelector(r.pdb.Spec.Selector.MatchLabels)
		if !psel.Matches(labels.Set(pod.Labels)) || r.pdb.Spec.MinAvailable == nil {
			t.Errorf("PodDisruptionBudget %+v does not cover the pods", r.pdb.Spec)
		}
	}
	if (r.monitor != nil) != optional("serviceMonitor") {
		t.Errorf("ServiceMonitor rendered %v, enabled %v", r.monitor != nil, optional("serviceMonitor"))
	} else if r.monitor != nil {
		msel, _ := metaSelector(r.monitor.Spec.Selector.MatchLabels)
		if !msel.Matches(labels.Set(r.service.Labels)) || len(r.monitor.Spec.Endpoints) == 0 ||
			r.monitor.Spec.Endpoints[0].Port != r.service.Spec.Ports[0].Name || r.monitor.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("ServiceMonitor %+v does not scrape the Service's /metrics", r.monitor.Spec)
		}
		// The alerting rules select up{job="kvgate"}: the operator takes
		// the job from the Service's label that jobLabel names, or else
		// from the Service's name (the release's).
		if job := r.service.Labels[r.monitor.Spec.JobLabel]; r.monitor.Spec.JobLabel == "" || job != "kvgate" {
			t.Errorf("ServiceMonitor's targets get job %q (jobLabel %q), want kvgate, which the alerting rules select", job, r.monitor.Spec.JobLabel)
		}
	}
	if (r.netpol != nil) != optional("networkPolicy") {
		t.Errorf("NetworkPolicy rendered %v, enabled %v", r.netpol != nil, optional("networkPolicy"))
	} else if r.netpol != nil {
		nsel, _ := metaSelector(r.netpol.Spec.PodSelector.MatchLabels)
		if !nsel.Matches(labels.Set(pod.Labels)) || len(r.netpol.Spec.Ingress) == 0 {
			t.Errorf("NetworkPolicy %+v does not cover the pods", r.netpol.Spec)
		}
	}
	if (r.scaled != nil) != optional("keda") {
		t.Errorf("ScaledObject rendered %v, enabled %v", r.scaled != nil, optional("keda"))
	} else if r.scaled != nil {
		spec := obj(r.scaled["spec"])
		if obj(spec["scaleTargetRef"])["name"] != obj(obj(merged["keda"])["scaleTargetRef"])["name"] {
			t.Errorf("ScaledObject scales %v, want keda.scaleTargetRef", spec["scaleTargetRef"])
		}
		var queries []string
		for _, tr := range spec["triggers"].([]any) {
			tr := obj(tr)
			if tr["type"] != "prometheus" {
				t.Errorf("trigger of type %v: kvgate scales vLLM on its backlog through Prometheus, never on CPU or memory", tr["type"])
			}
			queries = append(queries, fmt.Sprint(obj(tr["metadata"])["query"]))
		}
		all := strings.Join(queries, "\n")
		contains(t, "the ScaledObject's queries", all, "kvgate_jobs_oldest_runnable_age_seconds", "kvgate_jobs_runnable_tokens")
	}
	if gpuOn, _ := obj(merged["gpu"])["enabled"].(bool); gpuOn != strings.HasSuffix(ctr.Image, "-gpu") {
		t.Errorf("gpu.enabled %v, image %s", gpuOn, ctr.Image)
	}
}

// checkKvgateConfig loads a kvgate.yaml with kvgate's own loader, in an
// environment of env (NAME=value) alone.
func checkKvgateConfig(t *testing.T, text string, env ...string) {
	t.Helper()
	f := filepath.Join(t.TempDir(), "kvgate.yaml")
	if err := os.WriteFile(f, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	// gpus reads the same configuration as serve; its backends may not
	// answer here, which it reports without failing.
	cmd := exec.Command(kvgateBinary(t), "gpus", "--config", f)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("kvgate gpus --config (the chart's kvgate.yaml): %v\n%s\n%s", err, out, text)
	}
}

func metaSelector(m map[string]string) (labels.Selector, error) {
	if len(m) == 0 {
		return labels.Nothing(), fmt.Errorf("empty selector")
	}
	return labels.SelectorFromSet(m), nil
}

func mapsKeys(m map[string]string) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// TestHelmTemplateRefuses: values that would deploy something broken or
// leak a secret fail at render with a message naming the value.
func TestHelmTemplateRefuses(t *testing.T) {
	c := loadChart(t)
	base := func() map[string]any {
		return map[string]any{"secrets": map[string]any{"databaseURL": map[string]any{"name": "db"}},
			"config": map[string]any{"backends": []any{map[string]any{"url": "http://vllm-0.vllm:8000"}}}}
	}
	cases := []struct {
		name string
		edit func(v map[string]any)
		want string
	}{
		{"no database secret", func(v map[string]any) { delete(v, "secrets") }, "secrets.databaseURL.name"},
		{"no backends", func(v map[string]any) { delete(v, "config") }, "config.backends"},
		{"drain in config", func(v map[string]any) { v["config"].(map[string]any)["drain_timeout"] = "30s" }, "drainTimeoutSeconds"},
		{"store in config", func(v map[string]any) { v["config"].(map[string]any)["store"] = "postgres://u:p@h/db" }, "secrets.databaseURL"},
		{"keda without target", func(v map[string]any) { v["keda"] = map[string]any{"enabled": true} }, "keda.scaleTargetRef.name"},
		// values.schema.json, which helm applies before rendering:
		{"replicas as a string", func(v map[string]any) { v["replicaCount"] = "two" }, "replicaCount"},
		{"a misspelt key", func(v map[string]any) { v["replicas"] = 3 }, "replicas"},
		{"a grace period too short", func(v map[string]any) { v["terminationGraceExtraSeconds"] = 0 }, "terminationGraceExtraSeconds"},
		{"KEDA on a bad address", func(v map[string]any) {
			v["keda"] = map[string]any{"enabled": true, "scaleTargetRef": map[string]any{"name": "vllm"}, "prometheus": map[string]any{"serverAddress": "prometheus:9090"}}
		}, "serverAddress"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v := base()
			tc.edit(v)
			_, err := helmTemplate(t, c, v)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("helm template: %v; want an error naming %s", err, tc.want)
			}
		})
	}
	// Backends from the env Secret's KVGATE_BACKENDS, said so: rendered.
	v := base()
	delete(v, "config")
	v["backendsFromEnv"] = true
	if _, err := helmTemplate(t, c, v); err != nil {
		t.Errorf("backendsFromEnv without config.backends: %v", err)
	}
}

// TestScaledObjectSchemaCheck: the check refuses what KEDA's schema
// refuses, so that a pass above means something.
func TestScaledObjectSchemaCheck(t *testing.T) {
	good := func() map[string]any {
		return map[string]any{
			"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": map[string]any{"name": "x"},
			"spec": map[string]any{
				"scaleTargetRef": map[string]any{"name": "vllm"},
				"triggers": []any{map[string]any{"type": "prometheus", "metadata": map[string]any{
					"serverAddress": "http://p:9090", "query": "up", "threshold": "1"}}},
			},
		}
	}
	if errs := checkScaledObject(good()); len(errs) > 0 {
		t.Fatalf("a valid ScaledObject refused: %v", errs)
	}
	cases := map[string]func(so map[string]any){
		"unknown spec field":    func(so map[string]any) { obj(so["spec"])["replicas"] = 3.0 },
		"no triggers":           func(so map[string]any) { delete(obj(so["spec"]), "triggers") },
		"empty target name":     func(so map[string]any) { obj(so["spec"])["scaleTargetRef"] = map[string]any{"name": ""} },
		"integer metadata":      func(so map[string]any) { triggerMD(so)["threshold"] = 5.0 },
		"no query":              func(so map[string]any) { delete(triggerMD(so), "query") },
		"unknown scaler key":    func(so map[string]any) { triggerMD(so)["metricName"] = "x" },
		"string replica count":  func(so map[string]any) { obj(so["spec"])["maxReplicaCount"] = "4" },
		"bad metric type":       func(so map[string]any) { obj(obj(so["spec"])["triggers"].([]any)[0])["metricType"] = "Average" },
		"non-numeric threshold": func(so map[string]any) { triggerMD(so)["threshold"] = "lots" },
	}
	for name, edit := range cases {
		so := good()
		edit(so)
		if errs := checkScaledObject(so); len(errs) == 0 {
			t.Errorf("%s: accepted", name)
		}
	}
}

func triggerMD(so map[string]any) map[string]any {
	return obj(obj(obj(so["spec"])["triggers"].([]any)[0])["metadata"])
}
