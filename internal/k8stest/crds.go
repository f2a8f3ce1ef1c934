package k8stest

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"

	"github.com/baton-llm/baton/internal/poll"
)

// A CRD is a CustomResourceDefinition as its project publishes it: a file of the Go module that
// ships it, at a named version. Tests install these, never a schema of their own.
type CRD struct {
	Module, Version, File string
	// Resource is what the CRD serves (to wait until the API server serves it).
	Resource schema.GroupVersionResource
}

// The upstream CRDs Baton's chart and picker use.
var (
	// InferencePool v1 of the Gateway API Inference Extension.
	InferencePoolCRD = CRD{"sigs.k8s.io/gateway-api-inference-extension", "v1.0.0",
		"config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
		schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}}
	// KEDA's ScaledObject.
	ScaledObjectCRD = CRD{"github.com/kedacore/keda/v2", "v2.18.0", "config/crd/bases/keda.sh_scaledobjects.yaml",
		schema.GroupVersionResource{Group: "keda.sh", Version: "v1alpha1", Resource: "scaledobjects"}}
	// The Prometheus Operator's ServiceMonitor.
	ServiceMonitorCRD = CRD{"github.com/prometheus-operator/prometheus-operator", "v0.85.0",
		"example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
		schema.GroupVersionResource{Group: "monitoring.coreos.com", Version: "v1", Resource: "servicemonitors"}}
	// The Gateway API's Gateway and HTTPRoute (standard channel).
	GatewayCRD = CRD{"sigs.k8s.io/gateway-api", "v1.4.1", "config/crd/standard/gateway.networking.k8s.io_gateways.yaml",
		schema.GroupVersionResource{Group: "gateway.networking.k8s.io", Version: "v1", Resource: "gateways"}}
	HTTPRouteCRD = CRD{"sigs.k8s.io/gateway-api", "v1.4.1", "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml",
		schema.GroupVersionResource{Group: "gateway.networking.k8s.io", Version: "v1", Resource: "httproutes"}}
)

var moduleDirs sync.Map // module@version -> its directory in the module cache

// Read returns the CRD's object, from the module cache; the module is downloaded through the Go
// module proxy the first time.
func (c CRD) Read(t testing.TB) *unstructured.Unstructured {
	t.Helper()
	at := c.Module + "@" + c.Version
	dir, ok := moduleDirs.Load(at)
	if !ok {
		cmd := exec.Command("go", "mod", "download", "-json", at)
		cmd.Dir = os.TempDir() // outside Baton's module: the download changes no go.mod
		cmd.Env = append(os.Environ(), "GOFLAGS=")
		out, err := cmd.Output()
		var info struct{ Dir, Error string }
		if jerr := json.Unmarshal(out, &info); err != nil || jerr != nil || info.Dir == "" {
			t.Fatalf("go mod download %s: %v %s %s", at, err, info.Error, out)
		}
		dir = info.Dir
		moduleDirs.Store(at, dir)
	}
	b, err := os.ReadFile(filepath.Join(dir.(string), c.File))
	if err != nil {
		t.Fatalf("%s: %v", at, err)
	}
	var m map[string]any
	if err := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096).Decode(&m); err != nil {
		t.Fatalf("%s %s: %v", at, c.File, err)
	}
	u := &unstructured.Unstructured{Object: m}
	if u.GetKind() != "CustomResourceDefinition" {
		t.Fatalf("%s %s is a %s, not a CustomResourceDefinition", at, c.File, u.GetKind())
	}
	return u
}

var installMu sync.Mutex

// Install creates the CRD on the API server (once: an existing one is kept) and waits until it
// serves its resource.
func (c CRD) Install(t testing.TB, dyn dynamic.Interface) {
	t.Helper()
	installMu.Lock()
	defer installMu.Unlock()
	crd := c.Read(t)
	res := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	if _, err := res.Create(context.Background(), crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("installing %s: %v", crd.GetName(), err)
	}
	waitServed(t, dyn, c.Resource)
}

func waitServed(t testing.TB, dyn dynamic.Interface, gvr schema.GroupVersionResource) {
	t.Helper()
	poll.Until(t, gvr.Resource+" served", func() bool {
		_, err := dyn.Resource(gvr).Namespace("default").List(context.Background(), metav1.ListOptions{Limit: 1})
		return err == nil
	})
}
