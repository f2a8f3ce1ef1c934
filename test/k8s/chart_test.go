package k8s

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/k8stest"
)

const chart = "../../deploy/helm/baton"

// helm returns the helm binary that scripts/k8s-test-binaries.sh builds (the real tool, from
// the Go module proxy), skipping like the API server tests when it is absent.
func helm(t *testing.T) string {
	t.Helper()
	if p := k8stest.Helm(); p != "" {
		return p
	}
	k8stest.Require(t, nil)
	return ""
}

// render runs helm template with a values file ("" for the chart's defaults).
func render(t *testing.T, values, ns string) []*unstructured.Unstructured {
	t.Helper()
	args := []string{"template", "baton", chart, "--namespace", ns}
	if values != "" {
		args = append(args, "-f", values)
	}
	out, err := exec.Command(helm(t), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return decodeAll(t, out)
}

// decodeAll reads every object of a multi-document YAML.
func decodeAll(t *testing.T, out []byte) []*unstructured.Unstructured {
	t.Helper()
	var objs []*unstructured.Unstructured
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		var m map[string]any
		if err := dec.Decode(&m); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("rendered YAML: %v", err)
		}
		if len(m) > 0 {
			objs = append(objs, &unstructured.Unstructured{Object: m})
		}
	}
	return objs
}

// The chart renders with its defaults and each example's values, helm lint passes, the API
// server accepts every object it renders (created for real with strict field validation, in a
// namespace per render, against the CRDs their projects publish), and Baton accepts the
// configuration and flags the Deployment runs it with.
func TestChartRendersAndApplies(t *testing.T) {
	s := k8stest.Require(t, server)
	if out, err := exec.Command(helm(t), "lint", chart).CombinedOutput(); err != nil {
		t.Fatalf("helm lint: %v\n%s", err, out)
	}
	dyn := dynamic.NewForConfigOrDie(s.Config)
	cs, _ := cluster(t)
	for _, crd := range []k8stest.CRD{k8stest.ServiceMonitorCRD, k8stest.ScaledObjectCRD, k8stest.InferencePoolCRD, k8stest.GatewayCRD, k8stest.HTTPRouteCRD} {
		crd.Install(t, dyn)
	}
	// The repository's Gateway API example (a Gateway and an HTTPRoute to the pool) is taken
	// by the Gateway API's own CRDs, strictly.
	t.Run("gateway-api example", func(t *testing.T) {
		_, ns := cluster(t)
		b, err := os.ReadFile("../../examples/gateway-api/httproute.yaml")
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range decodeAll(t, b) {
			gvk := o.GroupVersionKind()
			res := k8stest.GatewayCRD.Resource
			if gvk.Kind == "HTTPRoute" {
				res = k8stest.HTTPRouteCRD.Resource
			}
			if _, err := dyn.Resource(res).Namespace(ns).Create(context.Background(), o, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
				t.Errorf("the API server refused %s %s: %v", gvk.Kind, o.GetName(), err)
			}
		}
	})
	examples, _ := filepath.Glob(chart + "/examples/*.yaml")
	for _, values := range append([]string{""}, examples...) {
		name := strings.TrimSuffix(filepath.Base(values), ".yaml")
		if values == "" {
			name = "defaults"
		}
		t.Run(name, func(t *testing.T) {
			_, ns := cluster(t)
			objs := render(t, values, ns)
			mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(cs.Discovery()))
			kinds := map[string]int{}
			var configYAML string
			var args []string
			var memLimit, goMemLimit string
			var grace, preStop int64
			var eppObjects string         // the rendered objects, for the Endpoint Picker's checks
			var advised int               // ScaledObjects on the PD advisor's recommendation
			keyEnv := map[string]string{} // BATON_* variable -> the Secret it is read from
			for _, o := range objs {
				gvk := o.GroupVersionKind()
				var m, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
				if err != nil {
					mapper.Reset() // the CRD may be new to the cache
					if m, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version); err != nil {
						t.Fatalf("%s: %v", gvk, err)
					}
				}
				res := dyn.Resource(m.Resource)
				var ri dynamic.ResourceInterface = res
				if m.Scope.Name() == "namespace" {
					ri = res.Namespace(nsOf(o, ns))
				}
				if _, err := ri.Create(context.Background(), o, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
					t.Errorf("the API server refused %s %s: %v", gvk.Kind, o.GetName(), err)
				}
				kinds[gvk.Kind]++
				if b, err := o.MarshalJSON(); err == nil {
					eppObjects += strings.ReplaceAll(string(b), `"`, "")
				}
				switch gvk.Kind {
				case "ConfigMap":
					configYAML, _, _ = unstructured.NestedString(o.Object, "data", "baton.yaml")
				case "ScaledObject":
					triggers, _, _ := unstructured.NestedSlice(o.Object, "spec", "triggers")
					query, _, _ := unstructured.NestedString(triggers[0].(map[string]any), "metadata", "query")
					role, _, _ := unstructured.NestedString(o.Object, "spec", "scaleTargetRef", "name")
					switch {
					case name == "pd-advisor": // each role's Deployment to the advisor's recommendation for it
						want := map[string]string{"vllm-prefill": "prefill", "vllm-decode": "decode"}[role]
						if query != `max(baton_pd_recommended_workers{role="`+want+`"})` {
							t.Errorf("the ScaledObject of %s: %s", role, query)
						}
						advised++
					case !strings.Contains(query, `baton_model_waiting_requests{model="llama-3-8b"}`) || !strings.Contains(query, "baton_model_in_flight_requests"):
						t.Errorf("the ScaledObject's query: %s", query)
					}
				case "Deployment":
					cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
					c := cs[0].(map[string]any)
					for _, a := range c["args"].([]any) {
						args = append(args, a.(string))
					}
					memLimit, _, _ = unstructured.NestedString(c, "resources", "limits", "memory")
					grace = number(o.Object, "spec", "template", "spec", "terminationGracePeriodSeconds")
					preStop = number(c, "lifecycle", "preStop", "sleep", "seconds")
					env, _, _ := unstructured.NestedSlice(c, "env")
					for _, e := range env {
						e := e.(map[string]any)
						if e["name"] == "GOMEMLIMIT" {
							goMemLimit, _ = e["value"].(string)
						}
						if n, _ := e["name"].(string); strings.HasPrefix(n, "BATON_") {
							secret, _, _ := unstructured.NestedString(e, "valueFrom", "secretKeyRef", "name")
							keyEnv[n] = secret
						}
					}
				}
			}
			for _, k := range []string{"Deployment", "Service", "ConfigMap", "ServiceAccount", "PodDisruptionBudget"} {
				if kinds[k] != 1 {
					t.Errorf("%d %s objects rendered", kinds[k], k)
				}
			}
			if strings.Contains(configYAML, "service_discovery: true") && (kinds["Role"] != 1 || kinds["RoleBinding"] != 1) {
				t.Errorf("discovery without its Role and RoleBinding: %v", kinds)
			}
			// The Go runtime's soft limit sits under the container's memory limit.
			if memLimit != "" {
				limit := resource.MustParse(memLimit)
				soft, ok := goMemBytes(goMemLimit)
				if !ok || soft >= limit.Value() || soft < limit.Value()/2 {
					t.Errorf("GOMEMLIMIT %q for a memory limit of %s: want a valid value between half of it and it", goMemLimit, memLimit)
				}
			}
			// Baton takes the rendered configuration with the Deployment's arguments (the tenants'
			// key files, which the Secret would mount, stand in a temporary directory).
			if strings.Contains(configYAML, "/etc/baton-keys/") {
				keys := t.TempDir()
				for i, name := range []string{"search", "batch"} {
					if err := os.WriteFile(filepath.Join(keys, name), []byte(fmt.Sprintf("sk-%d\n", i)), 0o600); err != nil {
						t.Fatal(err)
					}
				}
				configYAML = strings.ReplaceAll(configYAML, "/etc/baton-keys/", keys+"/")
			}
			file := filepath.Join(t.TempDir(), "baton.yaml")
			if err := os.WriteFile(file, []byte(configYAML), 0o600); err != nil {
				t.Fatal(err)
			}
			if len(args) == 0 || args[0] != map[bool]string{true: "epp", false: "serve"}[name == "epp"] {
				t.Fatalf("container args %q", args)
			}
			for i, a := range args {
				if a == "/etc/baton/baton.yaml" {
					args[i] = file
				}
				if strings.Contains(a, "BATON_") || strings.Contains(a, "api-key") {
					t.Errorf("a key on the command line (ps shows it): %q", a)
				}
			}
			cfg, err := config.Parse(args[1:], io.Discard)
			if err != nil {
				t.Errorf("Baton refuses the chart's configuration: %v\n%s", err, configYAML)
			}
			// Keys come from Secrets, by variable: the example's per-pod engine key under the name
			// its pods' baton.ai/api-key-env annotation gives.
			for n, secret := range keyEnv {
				if secret == "" {
					t.Errorf("%s is not read from a Secret", n)
				}
			}
			if name == "pd-vllm" && (keyEnv["BATON_WORKER_KEY_TEAM_A"] != "team-a-engine" || keyEnv["BATON_CLIENT_API_KEY"] != "baton-keys") {
				t.Errorf("key variables %v", keyEnv)
			}
			// HTTPS from a TLS Secret: Baton's flags name the mounted files, the probes use HTTPS.
			if name == "tenants" && (!slices.Contains(args, "--tls-cert-path") || cfg.TLSCertPath != "/etc/baton-tls/tls.crt" || cfg.TLSKeyPath != "/etc/baton-tls/tls.key" ||
				!strings.Contains(eppObjects, "scheme:HTTPS")) {
				t.Errorf("the TLS example: args %q, probes HTTPS %v", args, strings.Contains(eppObjects, "scheme:HTTPS"))
			}
			if name == "scale-from-zero" && kinds["ScaledObject"] != 1 {
				t.Errorf("the KEDA example rendered %d ScaledObjects", kinds["ScaledObject"])
			}
			if name == "pd-advisor" && (kinds["ScaledObject"] != 2 || advised != 2 || cfg.PDLocalPrefillThreshold != 512 || cfg.PDAdviceTPOTSLO != 50*time.Millisecond) {
				t.Errorf("the PD advisor example: %d ScaledObjects (%d on the advice), threshold %d, TPOT SLO %v", kinds["ScaledObject"], advised, cfg.PDLocalPrefillThreshold, cfg.PDAdviceTPOTSLO)
			}
			if name == "epp" {
				// The Endpoint Picker: its pool created, read through a Role that may read pools
				// and pods, its gRPC port on the Service, probed over gRPC health.
				if kinds["InferencePool"] != 1 || kinds["Role"] != 1 || cfg.InferencePool != "llama" || cfg.GRPCPort != 9002 {
					t.Errorf("epp: kinds %v, pool %q, grpc port %d", kinds, cfg.InferencePool, cfg.GRPCPort)
				}
				if !strings.Contains(eppObjects, "inferencepools") || !strings.Contains(eppObjects, "grpc:{port:9003,service:readiness}") {
					t.Errorf("epp: the Role or the probes (on the plaintext health port) miss the picker's parts")
				}
				// TLS on the gRPC port (a certificate made at startup), client certificates from
				// the CA Secret, and a NetworkPolicy that admits only the gateway to it.
				if !cfg.EPPSecureServing || cfg.GRPCHealthPort != 9003 || cfg.EPPClientCAPath != "/etc/baton-epp-ca/ca.crt" || !strings.Contains(eppObjects, "secretName:gateway-client-ca") {
					t.Errorf("epp: secure serving %v, health port %d, client CA %q", cfg.EPPSecureServing, cfg.GRPCHealthPort, cfg.EPPClientCAPath)
				}
				if kinds["NetworkPolicy"] != 1 || !strings.Contains(eppObjects, "app:istio-ingressgateway") || strings.Contains(eppObjects, "kubernetes.io/h2c") {
					t.Errorf("epp: %d NetworkPolicies, or the TLS port announced as cleartext", kinds["NetworkPolicy"])
				}
			}
			if name == "tenants" && keyEnv["BATON_RATE_LIMIT_STORE"] != "baton-redis" {
				t.Errorf("the Redis URL is not read from its Secret: %v", keyEnv)
			}
			// A rolling update: the preStop pause, then Baton's drain, within the grace period.
			if pre := preStop; pre <= 0 || grace <= 0 || time.Duration(grace)*time.Second < time.Duration(pre)*time.Second+cfg.ShutdownGracePeriod+5*time.Second {
				t.Errorf("grace period %d s, preStop %d s, drain %s: the drain does not fit", grace, pre, cfg.ShutdownGracePeriod)
			}
		})
	}
}

func nsOf(o *unstructured.Unstructured, def string) string {
	if ns := o.GetNamespace(); ns != "" {
		return ns
	}
	return def
}

// goMemBytes reads a GOMEMLIMIT value (bytes, or with a B/KiB/MiB/GiB/TiB suffix) as the Go
// runtime does.
func goMemBytes(v string) (int64, bool) {
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"B", 1}} {
		if strings.HasSuffix(v, u.suffix) {
			v, mult = strings.TrimSuffix(v, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return 0, false
	}
	return n * mult, true
}

// number reads a rendered number (YAML gives int64 or float64).
func number(obj map[string]any, fields ...string) int64 {
	v, _, _ := unstructured.NestedFieldNoCopy(obj, fields...)
	switch n := v.(type) {
	case int64:
		return n
	case float64:
		return int64(n)
	case int:
		return int64(n)
	}
	return 0
}
