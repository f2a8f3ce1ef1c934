// Package k8s tests Baton against a real kube-apiserver (and etcd): service discovery of
// worker pods, and the Helm chart's manifests. The binaries come from
// scripts/k8s-test-binaries.sh; without them the tests skip loudly (CI builds them and sets
// BATON_REQUIRE_K8S, so there they never skip).
package k8s

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/baton-llm/baton/internal/app"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/discovery"
	"github.com/baton-llm/baton/internal/k8stest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

var server *k8stest.Server

func TestMain(m *testing.M) { os.Exit(k8stest.Main(m, &server)) }

var nsCount atomic.Int64

// cluster returns a client and a fresh namespace for one test.
func cluster(t *testing.T) (*kubernetes.Clientset, string) {
	t.Helper()
	s := k8stest.Require(t, server)
	cs := kubernetes.NewForConfigOrDie(s.Config)
	ns := fmt.Sprintf("t%d-%d", time.Now().UnixNano()%1e6, nsCount.Add(1))
	if _, err := cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return cs, ns
}

func engine(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	c.Model = "m"
	e, err := sim.Start(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

func port(e *sim.Engine) string { return e.URL()[strings.LastIndex(e.URL(), ":")+1:] }

// gateway starts a Baton with cfg (no workers of its own) and discovery over ns.
func gateway(t *testing.T, cs kubernetes.Interface, ns string, cfg config.Config, sel map[string]map[string]string) (*app.Gateway, string) {
	t.Helper()
	g := discovering(t, cfg, &discovery.Discovery{Client: cs, Namespace: ns, Selectors: sel, Port: 8000})
	srv := httptest.NewServer(g.Server.Handler())
	t.Cleanup(srv.Close)
	return g, srv.URL
}

// discovering starts a Baton with cfg (no workers of its own) and runs d over its fleet, with
// short settling and unready delays, until the test ends.
func discovering(t *testing.T, cfg config.Config, d *discovery.Discovery) *app.Gateway {
	t.Helper()
	cfg.Host = "127.0.0.1"
	g, err := app.New(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); g.Wait() })
	if err := g.Start(ctx); err != nil {
		t.Fatal(err)
	}
	d.Fleet, d.Log = g.Fleet, slog.New(slog.DiscardHandler)
	if d.Settle == 0 && d.UnreadyRemoveAfter == 0 { // a test that gives its own keeps them
		d.Settle, d.UnreadyRemoveAfter = 20*time.Millisecond, 1500*time.Millisecond
	}
	g.UseDiscovery(d)
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return g
}

// pod creates a worker pod (scheduled on a node no kubelet runs: the test plays the kubelet).
func pod(t *testing.T, cs kubernetes.Interface, ns, name string, labels, annotations map[string]string) {
	t.Helper()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: annotations},
		Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "engine", Image: "engine:test"}}}}
	if _, err := cs.CoreV1().Pods(ns).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// setStatus patches a pod's status as a kubelet would: Running with an IP, Ready or not.
func setStatus(t *testing.T, cs kubernetes.Interface, ns, name string, ready bool) {
	t.Helper()
	cond := "False"
	if ready {
		cond = "True"
	}
	patch := fmt.Sprintf(`{"status":{"phase":"Running","podIP":"127.0.0.1","podIPs":[{"ip":"127.0.0.1"}],"conditions":[{"type":"Ready","status":%q}]}}`, cond)
	if _, err := cs.CoreV1().Pods(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}
}

func deletePod(t *testing.T, cs kubernetes.Interface, ns, name string) {
	t.Helper()
	zero := int64(0)
	if err := cs.CoreV1().Pods(ns).Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
}

func workerAt(g *app.Gateway, url string) *worker.Worker {
	return g.Registry.Snapshot().Get(url)
}

func complete(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hello","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, resp.Header.Get("X-Baton-Worker")
}

func changes(t *testing.T, g *app.Gateway, op string) int {
	t.Helper()
	rec := httptest.NewRecorder()
	g.Metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if v, ok := strings.CutPrefix(line, `baton_fleet_changes_total{op="`+op+`",source="kubernetes"} `); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return 0
}

// Pods join when Running and Ready, serve traffic, are cordoned while unready (and let back),
// leave when unready too long or deleted; pods that do not match, or carry a bad annotation,
// are not workers; a flapping pod does not churn the fleet.
func TestDiscoveryLifecycle(t *testing.T) {
	cs, ns := cluster(t)
	e1, e2, e3 := engine(t, sim.Config{Engine: sim.EngineVLLM}), engine(t, sim.Config{Engine: sim.EngineVLLM}), engine(t, sim.Config{Engine: sim.EngineVLLM})
	g, url := gateway(t, cs, ns, config.Default(), map[string]map[string]string{config.RoleRegular: {"app": "engine"}})
	match := map[string]string{"app": "engine"}
	pod(t, cs, ns, "p1", match, map[string]string{discovery.AnnotationPort: port(e1)})
	pod(t, cs, ns, "p2", match, map[string]string{discovery.AnnotationPort: port(e2)})
	pod(t, cs, ns, "other", map[string]string{"app": "db"}, map[string]string{discovery.AnnotationPort: port(e3)})
	pod(t, cs, ns, "bad", match, map[string]string{discovery.AnnotationPort: "eighty"})
	time.Sleep(200 * time.Millisecond)
	if n := len(g.Registry.Snapshot().Workers); n != 0 {
		t.Fatalf("%d workers before any pod is ready", n)
	}
	for _, p := range []string{"p1", "p2", "other", "bad"} {
		setStatus(t, cs, ns, p, true)
	}
	poll.Until(t, "p1 and p2 join and register", func() bool {
		w1, w2 := workerAt(g, e1.URL()), workerAt(g, e2.URL())
		return w1 != nil && w1.Ready() && w2 != nil && w2.Ready()
	})
	if n := len(g.Registry.Snapshot().Workers); n != 2 {
		t.Fatalf("%d workers: the unmatched pod or the one with a bad annotation joined", n)
	}
	if w := workerAt(g, e1.URL()); w.Labels[discovery.LabelPod] != "p1" || w.Labels[discovery.LabelNamespace] != ns || g.Fleet.SourceOf(w.URL) != "kubernetes" {
		t.Errorf("p1's worker: labels %v source %q", w.Labels, g.Fleet.SourceOf(w.URL))
	}
	if status, _ := complete(t, url); status != 200 {
		t.Fatalf("a request over discovered workers: %d", status)
	}

	// p1 unready: cordoned, traffic to p2 only; ready again: back, same worker (no churn).
	before := workerAt(g, e1.URL())
	setStatus(t, cs, ns, "p1", false)
	poll.Until(t, "p1 cordoned", func() bool { w := workerAt(g, e1.URL()); return w != nil && w.Cordoned() && !w.Ready() })
	for i := 0; i < 4; i++ {
		if status, on := complete(t, url); status != 200 || on != e2.URL() {
			t.Errorf("while p1 is unready: %d on %s", status, on)
		}
	}
	// Flapping: p1's readiness toggles quickly; the fleet is not changed for it.
	adds, removes := changes(t, g, "add"), changes(t, g, "remove")
	for i := 0; i <= 10; i++ { // ends ready
		setStatus(t, cs, ns, "p1", i%2 == 0)
	}
	poll.Until(t, "p1 back", func() bool { w := workerAt(g, e1.URL()); return w != nil && !w.Cordoned() && w.Ready() })
	if workerAt(g, e1.URL()) != before || changes(t, g, "add") != adds || changes(t, g, "remove") != removes {
		t.Errorf("flapping churned the fleet: adds %d→%d, removes %d→%d", adds, changes(t, g, "add"), removes, changes(t, g, "remove"))
	}

	// Unready for longer than allowed: p1 leaves. Deleted: p2 leaves.
	setStatus(t, cs, ns, "p1", false)
	poll.Until(t, "p1 leaves after staying unready", func() bool { return workerAt(g, e1.URL()) == nil })
	deletePod(t, cs, ns, "p2")
	poll.Until(t, "p2 leaves when deleted", func() bool { return workerAt(g, e2.URL()) == nil })
	if status, _ := complete(t, url); status != 503 && status != 404 {
		t.Errorf("with no workers left: %d", status)
	}
}

// A pod being deleted drains: a stream open on it runs to its end, then it leaves.
func TestDiscoveryDrainOnDelete(t *testing.T) {
	cs, ns := cluster(t)
	e := engine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 20 * time.Millisecond})
	g, url := gateway(t, cs, ns, config.Default(), map[string]map[string]string{config.RoleRegular: {"app": "engine"}})
	pod(t, cs, ns, "p", map[string]string{"app": "engine"}, map[string]string{discovery.AnnotationPort: port(e)})
	setStatus(t, cs, ns, "p", true)
	poll.Until(t, "p joins", func() bool { w := workerAt(g, e.URL()); return w != nil && w.Ready() })
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"long","max_tokens":30,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	poll.Until(t, "stream in flight", func() bool { return workerAt(g, e.URL()).InFlight() > 0 })
	deletePod(t, cs, ns, "p")
	poll.Until(t, "p draining", func() bool { w := workerAt(g, e.URL()); return w == nil || w.Draining() })
	body, err := io.ReadAll(resp.Body)
	if err != nil || !strings.Contains(string(body), "data: [DONE]") {
		t.Fatalf("the stream on the deleted pod did not finish: %v %q", err, body)
	}
	poll.Until(t, "p leaves", func() bool { return workerAt(g, e.URL()) == nil })
}

// Annotations set the PD worker's settings: role from the selectors, bootstrap port, runtime,
// models, KV connector and engine id, DP size, KV events endpoint ("*" is the pod's address).
func TestDiscoveryAnnotations(t *testing.T) {
	cs, ns := cluster(t)
	cfg := config.Default()
	cfg.PDDisaggregation = true
	g, _ := gateway(t, cs, ns, cfg, map[string]map[string]string{config.RolePrefill: {"role": "prefill"}, config.RoleDecode: {"role": "decode"}})
	pod(t, cs, ns, "pre", map[string]string{"role": "prefill"}, map[string]string{
		discovery.AnnotationPort: "18001", discovery.AnnotationBootstrapPort: "8998", discovery.AnnotationRuntime: "vllm",
		discovery.AnnotationModels: "m1, m2", discovery.AnnotationKVConnector: "MooncakeConnector", discovery.AnnotationKVEngineID: "engine-7",
		discovery.AnnotationDPSize: "2", discovery.AnnotationKVEvents: "tcp://*:5557", discovery.AnnotationKVEventsReplay: "tcp://*:5558"})
	pod(t, cs, ns, "dec", map[string]string{"role": "decode"}, map[string]string{discovery.AnnotationPort: "18002", discovery.AnnotationRuntime: "vllm"})
	setStatus(t, cs, ns, "pre", true)
	setStatus(t, cs, ns, "dec", true)
	poll.Until(t, "both join", func() bool { return len(g.Registry.Snapshot().Workers) == 2 })
	pre, dec := workerAt(g, "http://127.0.0.1:18001"), workerAt(g, "http://127.0.0.1:18002")
	if pre == nil || dec == nil {
		t.Fatalf("workers %v", g.Registry.Snapshot().Workers)
	}
	c := pre.Configured()
	got, _ := json.Marshal(map[string]any{"role": pre.Role, "runtime": c.Runtime, "models": c.Models, "bootstrap": *pre.BootstrapPort,
		"connector": pre.KVConnector, "engine": pre.KVEngineID, "dp": pre.DPSize, "events": pre.KVEventsEndpoint, "replay": pre.KVEventsReplayEndpoint})
	want := `{"bootstrap":8998,"connector":"MooncakeConnector","dp":2,"engine":"engine-7","events":"tcp://127.0.0.1:5557","models":["m1","m2"],"replay":"tcp://127.0.0.1:5558","role":"prefill","runtime":"vllm"}`
	if string(got) != want {
		t.Errorf("prefill from annotations:\n got %s\nwant %s", got, want)
	}
	if dec.Role != config.RoleDecode {
		t.Errorf("decode role %q", dec.Role)
	}
	// An annotation changes: the worker is updated in place of the old one.
	if _, err := cs.CoreV1().Pods(ns).Patch(context.Background(), "pre", types.MergePatchType, []byte(`{"metadata":{"annotations":{"baton.ai/kv-engine-id":"engine-8"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the annotation change applied", func() bool { w := workerAt(g, "http://127.0.0.1:18001"); return w != nil && w.KVEngineID == "engine-8" })
}

// The API server stops and comes back: the discovered workers stay meanwhile, the status page
// and baton_service_discovery_connected say it is lost, and changes made after it returns are
// seen.
func TestDiscoverySurvivesAPIServerRestart(t *testing.T) {
	cs, ns := cluster(t)
	e1, e2 := engine(t, sim.Config{Engine: sim.EngineVLLM}), engine(t, sim.Config{Engine: sim.EngineVLLM})
	g, url := gateway(t, cs, ns, config.Default(), map[string]map[string]string{config.RoleRegular: {"app": "engine"}})
	pod(t, cs, ns, "p1", map[string]string{"app": "engine"}, map[string]string{discovery.AnnotationPort: port(e1)})
	setStatus(t, cs, ns, "p1", true)
	poll.Until(t, "p1 joins", func() bool { w := workerAt(g, e1.URL()); return w != nil && w.Ready() })

	if connected(t, g) != 1 || len(notices(t, g)) != 0 {
		t.Fatalf("discovery not shown connected: %v", notices(t, g))
	}

	server.StopAPIServer()
	poll.Until(t, "the lost API server shown", func() bool { return connected(t, g) == 0 })
	if n := notices(t, g); len(n) != 1 || !strings.Contains(n[0], "API server has not answered") || !strings.Contains(n[0], "The 1 discovered workers stay") {
		t.Errorf("status page notices: %q", n)
	}
	if status, on := complete(t, url); status != 200 || on != e1.URL() {
		t.Errorf("while the API server is down: %d on %s", status, on)
	}
	if err := server.StartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the API server shown back", func() bool { return connected(t, g) == 1 && len(notices(t, g)) == 0 })
	cs = kubernetes.NewForConfigOrDie(server.Config)
	pod(t, cs, ns, "p2", map[string]string{"app": "engine"}, map[string]string{discovery.AnnotationPort: port(e2)})
	setStatus(t, cs, ns, "p2", true)
	poll.Until(t, "p2 joins after the restart", func() bool { w := workerAt(g, e2.URL()); return w != nil && w.Ready() })
	if workerAt(g, e1.URL()) == nil {
		t.Error("p1 left over the restart")
	}
}

// A lost API server is seen within seconds with the default settings, whatever
// UnreadyRemoveAfter is: baton_service_discovery_connected drops to 0 within 10 s of the stop
// (its probe ran at a quarter of UnreadyRemoveAfter, 15 s by default), and back to 1 once it
// answers again.
func TestALostAPIServerIsSeenWithinSeconds(t *testing.T) {
	cs, ns := cluster(t)
	e := engine(t, sim.Config{Engine: sim.EngineVLLM})
	// discovery's own defaults: a probe every 2 s, whatever UnreadyRemoveAfter is
	g := discovering(t, config.Default(), &discovery.Discovery{Client: cs, Namespace: ns, Port: 8000,
		Selectors: map[string]map[string]string{config.RoleRegular: {"app": "engine"}}, Settle: 250 * time.Millisecond, UnreadyRemoveAfter: time.Minute})
	pod(t, cs, ns, "p1", map[string]string{"app": "engine"}, map[string]string{discovery.AnnotationPort: port(e)})
	setStatus(t, cs, ns, "p1", true)
	poll.Until(t, "p1 joins", func() bool { w := workerAt(g, e.URL()); return w != nil && w.Ready() })

	server.StopAPIServer()
	stopped := time.Now()
	for connected(t, g) != 0 {
		if time.Since(stopped) > 10*time.Second {
			t.Fatal("the API server stopped 10 s ago and discovery still shows it connected")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("seen lost after %s", time.Since(stopped).Round(100*time.Millisecond))
	if err := server.StartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the API server shown back", func() bool { return connected(t, g) == 1 })
}

// connected is baton_service_discovery_connected.
func connected(t *testing.T, g *app.Gateway) float64 {
	t.Helper()
	mfs, err := g.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "baton_service_discovery_connected" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no baton_service_discovery_connected")
	return -1
}

// notices are the status page's notices.
func notices(t *testing.T, g *app.Gateway) []string {
	t.Helper()
	rec := httptest.NewRecorder()
	g.Server.StatusHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/status.json", nil))
	var s struct {
		Notices []struct{ Text string } `json:"notices"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &s); err != nil {
		t.Fatalf("status.json: %v: %s", err, rec.Body)
	}
	var out []string
	for _, n := range s.Notices {
		out = append(out, n.Text)
	}
	return out
}
