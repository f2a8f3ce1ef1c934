package discovery

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/baton-llm/baton/internal/config"
)

func kubeconfig(t *testing.T, server string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	os.WriteFile(path, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "`+server+`"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: ns}}]
current-context: x
`), 0o600)
	return path
}

// Startup fails, naming the fix, when discovery could find no worker: an invalid selector, an
// API server that does not answer, one that forbids listing pods.
func TestNewRefusesWhatWouldFindNoWorker(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	closed := "http://" + ln.Addr().String()
	ln.Close()
	forbidding := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusForbidden)
		io.WriteString(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403,"message":"pods is forbidden"}`)
	}))
	defer forbidding.Close()
	for _, c := range []struct {
		name string
		cfg  config.Config
		want string
	}{
		{"invalid selector", config.Config{ServiceDiscovery: true, Selector: map[string]string{"app": "not valid!"}, KubeConfig: kubeconfig(t, closed)}, "no valid label selector"},
		{"API server down", config.Config{ServiceDiscovery: true, Selector: map[string]string{"app": "vllm"}, KubeConfig: kubeconfig(t, closed), ServiceDiscoveryNamespace: "ns"}, "does not answer"},
		{"pods forbidden", config.Config{ServiceDiscovery: true, Selector: map[string]string{"app": "vllm"}, KubeConfig: kubeconfig(t, forbidding.URL), ServiceDiscoveryNamespace: "ns"}, "grant its service account get, list and watch on pods"},
	} {
		if _, err := New(c.cfg, nil, log); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.want)
		}
	}
}

// A pod's engine key comes from the Baton environment variable its annotation names — only one
// named BATON_WORKER_KEY_…, so that a pod cannot have Baton send it Baton's own keys — and a
// variable that is not set skips the pod with the name in the error, never a key.
func TestPodKeyFromBatonsEnvironment(t *testing.T) {
	env := map[string]string{"BATON_WORKER_KEY_TEAM_A": "sk-engine-a", "BATON_API_KEY": "sk-clients", "BATON_ADMIN_API_KEY": "sk-admin"}
	d := &Discovery{Port: 8000, Getenv: func(k string) string { return env[k] }}
	pod := func(name string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"}, Status: corev1.PodStatus{PodIP: "10.0.0.7"}}
		if name != "" {
			p.Annotations = map[string]string{AnnotationAPIKeyEnv: name}
		}
		return p
	}
	w, err := d.workerOf(pod("BATON_WORKER_KEY_TEAM_A"), config.RoleRegular, 8000)
	if err != nil || w.APIKey != "sk-engine-a" {
		t.Fatalf("key %q, %v", w.APIKey, err)
	}
	if w, err := d.workerOf(pod(""), config.RoleRegular, 8000); err != nil || w.APIKey != "" {
		t.Errorf("no annotation: key %q, %v", w.APIKey, err)
	}
	for _, name := range []string{"BATON_API_KEY", "BATON_CLIENT_API_KEY", "BATON_ADMIN_API_KEY", "BATON_WORKER_KEY_", "HOME"} {
		if _, err := d.workerOf(pod(name), config.RoleRegular, 8000); err == nil || !strings.Contains(err.Error(), "must start with BATON_WORKER_KEY_") {
			t.Errorf("%s: %v", name, err)
		}
	}
	_, err = d.workerOf(pod("BATON_WORKER_KEY_TEAM_B"), config.RoleRegular, 8000)
	if err == nil || !strings.Contains(err.Error(), "BATON_WORKER_KEY_TEAM_B, which Baton's environment does not set") {
		t.Errorf("unset variable: %v", err)
	}
	for _, k := range env {
		if err != nil && strings.Contains(err.Error(), k) {
			t.Errorf("the error shows a key: %v", err)
		}
	}
}

// baton.ai/forward-priority marks a pod's engine as scheduling by priority, with its order.
func TestPodForwardPriority(t *testing.T) {
	d := &Discovery{Port: 8000}
	for v, want := range map[string][2]string{"true": {"true", ""}, "higher_first": {"true", "higher_first"}, "": {"false", ""}} {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Annotations: map[string]string{AnnotationForwardPriority: v}}, Status: corev1.PodStatus{PodIP: "10.0.0.7"}}
		w, err := d.workerOf(p, config.RoleRegular, 8000)
		if err != nil || fmt.Sprint(w.ForwardPriority) != want[0] || w.PriorityOrder != want[1] {
			t.Errorf("%q: %v %q %v", v, w.ForwardPriority, w.PriorityOrder, err)
		}
	}
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Annotations: map[string]string{AnnotationForwardPriority: "yes"}}, Status: corev1.PodStatus{PodIP: "10.0.0.7"}}
	if _, err := d.workerOf(p, config.RoleRegular, 8000); err == nil {
		t.Error("an unknown value accepted")
	}
}
