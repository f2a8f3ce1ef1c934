// Package discovery finds Baton's workers among Kubernetes pods: a pod informer on one
// namespace (RBAC: get, list and watch pods there), pods matched to roles by label selectors,
// per-pod settings from annotations. A pod joins once it is Running and Ready with an IP; a
// pod that stops being ready is cordoned (no new requests, the ones in flight finish) and
// leaves if it stays unready; a deleted or terminating pod drains and leaves.
package discovery

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/baton-llm/baton/internal/config"
)

// The annotations a worker pod may carry. sglang.ai/bootstrap-port is read as smg reads it.
const (
	AnnotationBootstrapPort  = "sglang.ai/bootstrap-port"
	AnnotationPort           = "baton.ai/port"
	AnnotationRuntime        = "baton.ai/runtime"
	AnnotationModels         = "baton.ai/models"
	AnnotationKVConnector    = "baton.ai/kv-connector"
	AnnotationKVEngineID     = "baton.ai/kv-engine-id"
	AnnotationDPSize         = "baton.ai/dp-size"
	AnnotationKVEvents       = "baton.ai/kv-events-endpoint"
	AnnotationKVEventsReplay = "baton.ai/kv-events-replay-endpoint"
	// AnnotationAPIKeyEnv names the environment variable of Baton's that holds the pod's engine
	// key (a Secret mounted into Baton's pod): never the key itself, which any reader of the pod
	// would see. Only variables named WorkerKeyEnvPrefix…: a pod cannot have Baton send it
	// Baton's own keys.
	AnnotationAPIKeyEnv = "baton.ai/api-key-env"
	WorkerKeyEnvPrefix  = "BATON_WORKER_KEY_"
	// AnnotationForwardPriority marks a pod whose engine schedules by priority ("true", or its
	// order: "lower_first", "higher_first"): it gets the class in its requests' priority field.
	AnnotationForwardPriority   = "baton.ai/forward-priority"
	LabelPod, LabelNamespace    = "k8s_pod", "k8s_namespace"
	defaultUnreadyRemoveAfter   = 60 * time.Second
	defaultSettle               = 250 * time.Millisecond
	maxAnnotationValue          = 1024
	serviceAccountNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
)

// Fleet is what discovery changes.
type Fleet interface {
	// Sync makes the discovered workers those of want.
	Sync(want []config.Worker, source string) error
	// Cordon holds a worker out of rotation, or lets it back.
	Cordon(url string, on bool) bool
}

// Discovery watches pods and keeps the fleet's discovered workers in step.
type Discovery struct {
	Client    kubernetes.Interface
	Namespace string
	// Selectors by role (regular, prefill, decode); empty selectors match nothing.
	Selectors map[string]map[string]string
	Port      int
	// Pool, when set, names the InferencePool (inference.networking.k8s.io/v1, in Namespace)
	// whose selector and target ports say which pods are workers, on which ports: the pool is
	// watched through Dynamic, and Selectors only split its pods into prefill and decode.
	Pool    string
	Dynamic dynamic.Interface
	Fleet   Fleet
	Log     *slog.Logger
	// UnreadyRemoveAfter is how long a pod that joined may stay unready (cordoned) before it
	// leaves; Settle coalesces bursts of pod events into one fleet change; Resync is the
	// informer's full resync period.
	UnreadyRemoveAfter, Settle, Resync time.Duration
	// Getenv reads Baton's environment for baton.ai/api-key-env (nil: os.Getenv).
	Getenv func(string) string

	mu        sync.Mutex
	lostSince time.Time            // when the API server stopped answering; zero while it answers
	lostErr   string               // what it answered last, while lost
	members   map[string]time.Time // pod UID -> when it was last seen ready (joined pods)
	warned    map[string]string    // pod UID -> resourceVersion whose problem was logged
	selectors map[string]labels.Selector
	pool      poolState
	synced    bool          // the pods (and the pool, when one is watched) were listed once
	kick      chan struct{} // asks Run to apply the pods again
}

// poolState is what the watched InferencePool says now.
type poolState struct {
	found bool            // the pool exists
	sel   labels.Selector // its pod selector
	ports []int           // its target ports
	err   string          // why its spec could not be used ("" when it could)
}

// New returns discovery for cfg, with the in-cluster service account or cfg.KubeConfig.
//
// Startup fails, naming the fix, on what would otherwise leave the gateway without workers: a
// selector that is no valid Kubernetes label selector, and an API server that does not answer,
// or does not let Baton list the pods of its namespace.
func New(cfg config.Config, fleet Fleet, log *slog.Logger) (*Discovery, error) {
	selectors := map[string]map[string]string{config.RoleRegular: cfg.Selector, config.RolePrefill: cfg.PrefillSelector, config.RoleDecode: cfg.DecodeSelector}
	for role, set := range selectors {
		if _, err := labels.ValidatedSelectorFromSet(set); err != nil {
			return nil, fmt.Errorf("service discovery: the %s selector is no valid label selector (%v): give label keys and values as Kubernetes allows them, k=v", role, err)
		}
	}
	rc, err := restConfig(cfg.KubeConfig)
	if err != nil {
		return nil, fmt.Errorf("service discovery: no Kubernetes API server to ask (%w): run Baton in a pod with a service account, or give --kubeconfig", err)
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("service discovery: %w", err)
	}
	ns := cfg.ServiceDiscoveryNamespace
	if ns == "" {
		ns = "default"
		if b, err := os.ReadFile(serviceAccountNamespaceFile); err == nil && len(strings.TrimSpace(string(b))) > 0 {
			ns = strings.TrimSpace(string(b))
		}
	}
	if err := preflight(cs, rc.Host, ns); err != nil {
		return nil, err
	}
	d := &Discovery{Client: cs, Namespace: ns, Port: cfg.ServiceDiscoveryPort, Fleet: fleet, Log: log, Selectors: selectors}
	if cfg.InferencePool != "" {
		d.Pool = cfg.InferencePool
		if d.Dynamic, err = dynamic.NewForConfig(rc); err != nil {
			return nil, fmt.Errorf("service discovery: %w", err)
		}
		if err := poolPreflight(context.Background(), d); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// preflightTimeout bounds the startup check that the API server answers.
const preflightTimeout = 10 * time.Second

// preflight lists one pod of ns: the API server answers, and lets Baton list pods there.
func preflight(cs kubernetes.Interface, host, ns string) error {
	ctx, cancel := context.WithTimeout(context.Background(), preflightTimeout)
	defer cancel()
	_, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{Limit: 1})
	switch {
	case err == nil:
		return nil
	case apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err):
		return fmt.Errorf("service discovery: the API server at %s does not let Baton list the pods of namespace %q (%v): grant its service account get, list and watch on pods there (the chart's Role does)", host, ns, err)
	}
	return fmt.Errorf("service discovery: the API server at %s does not answer (%v): check --kubeconfig, or that the pod can reach the in-cluster API server", host, err)
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		return clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	return rest.InClusterConfig()
}

// Health is what discovery knows of its API server now.
type Health struct {
	// Connected: the last list or watch succeeded (or none failed yet).
	Connected bool
	// Since is when the API server stopped answering; Err what the last attempt got.
	Since time.Time
	Err   string
	// Workers is the number of discovered workers kept meanwhile.
	Workers int
}

// Health reports whether the API server answers. While it does not, the discovered workers stay
// as they were.
func (d *Discovery) Health() Health {
	d.mu.Lock()
	defer d.mu.Unlock()
	return Health{Connected: d.lostSince.IsZero(), Since: d.lostSince, Err: d.lostErr, Workers: len(d.members)}
}

// maxLostErr bounds the API server's error kept for the status page.
const maxLostErr = 300

// lost notes that a list or watch failed; the first failure after a success is logged.
func (d *Discovery) lost(err error) {
	if errors.Is(err, io.EOF) || apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
		return // a watch that ended, or a resource version too old: the informer lists again
	}
	msg := err.Error()
	if len(msg) > maxLostErr {
		msg = msg[:maxLostErr] + "…"
	}
	d.mu.Lock()
	first := d.lostSince.IsZero()
	if first {
		d.lostSince = time.Now()
	}
	d.lostErr = msg
	n := len(d.members)
	d.mu.Unlock()
	if first {
		d.Log.Warn("service discovery: the API server does not answer; the discovered workers stay as they are until it does", "namespace", d.Namespace, "workers_kept", n, "err", msg)
	}
}

// probeTimeout bounds the check that the API server answers; probeEvery is how often it runs
// at most apart (a lost API server is seen within seconds: at a quarter of UnreadyRemoveAfter,
// 15 s by default, the soak found it unseen for 10 s).
const (
	probeTimeout = 5 * time.Second
	probeEvery   = 2 * time.Second
)

// probe asks the API server for one pod of the namespace. The informer alone does not tell: it
// waits out a refused connection without a word, keeping its last view.
func (d *Discovery) probe(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	if _, err := d.Client.CoreV1().Pods(d.Namespace).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
		if ctx.Err() == nil || errors.Is(ctx.Err(), context.DeadlineExceeded) {
			d.lost(err)
		}
		return
	}
	d.mu.Lock()
	since := d.lostSince
	d.lostSince, d.lostErr = time.Time{}, ""
	d.mu.Unlock()
	if !since.IsZero() {
		d.Log.Info("service discovery: the API server answers again", "namespace", d.Namespace, "lost_for", time.Since(since).Round(time.Second).String())
	}
}

// poke asks Run to apply the pods again.
func (d *Discovery) poke() {
	d.mu.Lock()
	kick := d.kick
	d.mu.Unlock()
	select {
	case kick <- struct{}{}:
	default:
	}
}

// Synced reports whether the workers are those the API server showed at least once: the pods
// were listed and applied (and the pool, when one is watched, was found with a usable spec).
func (d *Discovery) Synced() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.synced && (d.Pool == "" || d.pool.found && d.pool.err == "")
}

// PoolProblem says why the watched InferencePool gives no workers ("" when it does, or none is
// watched).
func (d *Discovery) PoolProblem() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.Pool == "":
		return ""
	case !d.pool.found:
		return fmt.Sprintf("the InferencePool %s/%s does not exist", d.Namespace, d.Pool)
	}
	return d.pool.err
}

// SourceKubernetes names the workers discovery manages.
const SourceKubernetes = "kubernetes"

// Run watches pods until ctx ends. It returns an error when a selector is invalid; a lost or
// restarted API server is waited out (the informer lists and watches again, and the workers
// stay as they were meanwhile), and shown by Health.
func (d *Discovery) Run(ctx context.Context) error {
	d.mu.Lock()
	d.members, d.warned, d.selectors = map[string]time.Time{}, map[string]string{}, map[string]labels.Selector{}
	d.lostSince, d.lostErr = time.Time{}, ""
	for role, set := range d.Selectors {
		if len(set) == 0 {
			continue
		}
		sel, err := labels.ValidatedSelectorFromSet(set)
		if err != nil {
			d.mu.Unlock()
			return fmt.Errorf("service discovery: %s selector: %w", role, err)
		}
		d.selectors[role] = sel
	}
	d.mu.Unlock()
	if d.UnreadyRemoveAfter == 0 {
		d.UnreadyRemoveAfter = defaultUnreadyRemoveAfter
	}
	if d.Settle == 0 {
		d.Settle = defaultSettle
	}
	if d.Resync == 0 {
		d.Resync = 60 * time.Second
	}
	factory := informers.NewSharedInformerFactoryWithOptions(d.Client, d.Resync, informers.WithNamespace(d.Namespace))
	pods := factory.Core().V1().Pods()
	kick := make(chan struct{}, 1)
	d.mu.Lock()
	d.kick = kick
	d.mu.Unlock()
	poke := d.poke
	if _, err := pods.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	}); err != nil {
		return err
	}
	if err := pods.Informer().SetWatchErrorHandler(func(_ *cache.Reflector, err error) { d.lost(err) }); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	synced := []cache.InformerSynced{pods.Informer().HasSynced}
	if d.Pool != "" {
		pool, err := d.watchPool(ctx)
		if err != nil {
			return err
		}
		synced = append(synced, pool)
		d.Log.Info("service discovery: watching an InferencePool and its pods", "namespace", d.Namespace, "pool", d.Pool,
			"prefill_selector", d.Selectors[config.RolePrefill], "decode_selector", d.Selectors[config.RoleDecode])
	} else {
		d.Log.Info("service discovery: watching pods", "namespace", d.Namespace, "selectors", d.Selectors, "port", d.Port)
	}
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return nil
	}
	lister := pods.Lister()
	tick := time.NewTicker(min(max(d.UnreadyRemoveAfter/4, time.Second), probeEvery))
	defer tick.Stop()
	for {
		list, err := lister.Pods(d.Namespace).List(labels.Everything())
		if err == nil {
			d.apply(list, time.Now())
			d.mu.Lock()
			d.synced = true
			d.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
		case <-tick.C:
			d.probe(ctx)
		}
		// Coalesce a burst (a rollout, a flapping probe) into one change.
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(d.Settle):
		}
		select {
		case <-kick:
		default:
		}
	}
}

// apply computes the workers the pods describe and hands them to the fleet, then cordons the
// joined pods that are not ready and lets the ready ones back.
func (d *Discovery) apply(pods []*corev1.Pod, now time.Time) {
	d.mu.Lock()
	var want []config.Worker
	cordon := map[string]bool{}
	live := map[string]bool{}
	for _, p := range pods {
		role := d.roleOf(p)
		if role == "" {
			continue
		}
		uid := string(p.UID)
		ready := podReady(p)
		_, joined := d.members[uid]
		switch {
		case p.DeletionTimestamp != nil || p.Status.PodIP == "" || p.Status.Phase != corev1.PodRunning && !joined:
			continue // terminating, or never ran: not a worker (any more)
		case ready:
			d.members[uid] = now
		case !joined:
			continue // joins once it is ready
		case now.Sub(d.members[uid]) > d.UnreadyRemoveAfter:
			continue // unready too long: leaves
		}
		for _, port := range d.portsOf(p) {
			w, err := d.workerOf(p, role, port)
			if err != nil {
				if d.warned[uid] != p.ResourceVersion {
					d.warned[uid] = p.ResourceVersion
					d.Log.Warn("service discovery: pod skipped", "pod", p.Name, "err", err)
				}
				continue
			}
			live[uid] = true
			want = append(want, w)
			cordon[w.URL] = !ready
		}
	}
	for uid := range d.members {
		if !live[uid] {
			delete(d.members, uid)
			delete(d.warned, uid)
		}
	}
	d.mu.Unlock()
	if err := d.Fleet.Sync(want, SourceKubernetes); err != nil {
		d.Log.Warn("service discovery: some pods could not be applied", "err", err)
	}
	for url, on := range cordon {
		d.Fleet.Cordon(url, on)
	}
}

// roleOf returns the role whose selector p matches (prefill, then decode, then regular), ""
// for none. Called with d.mu held.
func (d *Discovery) roleOf(p *corev1.Pod) string {
	set := labels.Set(p.Labels)
	if d.Pool != "" {
		if !d.pool.found || d.pool.sel == nil || !d.pool.sel.Matches(set) {
			return ""
		}
		for _, role := range []string{config.RolePrefill, config.RoleDecode} {
			if sel, ok := d.selectors[role]; ok && sel.Matches(set) {
				return role
			}
		}
		return config.RoleRegular
	}
	for _, role := range []string{config.RolePrefill, config.RoleDecode, config.RoleRegular} {
		if sel, ok := d.selectors[role]; ok && sel.Matches(set) {
			return role
		}
	}
	return ""
}

func podReady(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// portsOf are the ports of p's workers: the pool's target ports, else the discovery port or
// the pod's baton.ai/port (0 when that is no port: workerOf says why). Called with d.mu held.
func (d *Discovery) portsOf(p *corev1.Pod) []int {
	if d.Pool != "" {
		return d.pool.ports
	}
	if v, ok := p.Annotations[AnnotationPort]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 65535 {
			return []int{0}
		}
		return []int{n}
	}
	return []int{d.Port}
}

// workerOf describes the worker a pod is on port, from its IP and its annotations.
func (d *Discovery) workerOf(p *corev1.Pod, role string, port int) (config.Worker, error) {
	a := p.Annotations
	for k, v := range a {
		if (strings.HasPrefix(k, "baton.ai/") || k == AnnotationBootstrapPort) && len(v) > maxAnnotationValue {
			return config.Worker{}, fmt.Errorf("annotation %s is longer than %d bytes", k, maxAnnotationValue)
		}
	}
	if port == 0 {
		return config.Worker{}, fmt.Errorf("%s %q is not a port", AnnotationPort, a[AnnotationPort])
	}
	ip := p.Status.PodIP
	w := config.Worker{URL: "http://" + net.JoinHostPort(ip, strconv.Itoa(port)), Role: role, Runtime: a[AnnotationRuntime],
		KVConnector: a[AnnotationKVConnector], KVEngineID: a[AnnotationKVEngineID],
		Labels: map[string]string{LabelPod: p.Name, LabelNamespace: p.Namespace}}
	if v := a[AnnotationModels]; v != "" {
		for _, m := range strings.Split(v, ",") {
			if m = strings.TrimSpace(m); m != "" {
				w.Models = append(w.Models, m)
			}
		}
	}
	if v, ok := a[AnnotationBootstrapPort]; ok && role == config.RolePrefill {
		// One value for the pod (a list aligned with several ports, as smg allows, is not
		// supported: Baton has one worker per pod).
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 1 || n > 65535 {
			return config.Worker{}, fmt.Errorf("%s %q is not a port", AnnotationBootstrapPort, v)
		}
		w.BootstrapPort = &n
	}
	if v, ok := a[AnnotationDPSize]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > config.MaxDPSize {
			return config.Worker{}, fmt.Errorf("%s %q is not a data parallel size", AnnotationDPSize, v)
		}
		w.DPSize = n
	}
	// A KV events endpoint may name the pod's own address as "*" (the engine binds every
	// interface): tcp://*:5557.
	host := ip
	if strings.Contains(ip, ":") {
		host = "[" + ip + "]"
	}
	for _, e := range []struct {
		key string
		dst *string
	}{{AnnotationKVEvents, &w.KVEventsEndpoint}, {AnnotationKVEventsReplay, &w.KVEventsReplayEndpoint}} {
		if v := a[e.key]; v != "" {
			*e.dst = strings.Replace(v, "tcp://*:", "tcp://"+host+":", 1)
		}
	}
	switch v := a[AnnotationForwardPriority]; v {
	case "":
	case "true":
		w.ForwardPriority = true
	case config.PriorityLowerFirst, config.PriorityHigherFirst:
		w.ForwardPriority, w.PriorityOrder = true, v
	default:
		return config.Worker{}, fmt.Errorf("%s %q: want true, lower_first or higher_first", AnnotationForwardPriority, v)
	}
	if name, ok := a[AnnotationAPIKeyEnv]; ok {
		if !strings.HasPrefix(name, WorkerKeyEnvPrefix) || len(name) == len(WorkerKeyEnvPrefix) {
			return config.Worker{}, fmt.Errorf("%s %q: the variable's name must start with %s", AnnotationAPIKeyEnv, name, WorkerKeyEnvPrefix)
		}
		getenv := d.Getenv
		if getenv == nil {
			getenv = os.Getenv
		}
		if w.APIKey = getenv(name); w.APIKey == "" {
			return config.Worker{}, fmt.Errorf("%s names %s, which Baton's environment does not set", AnnotationAPIKeyEnv, name)
		}
	}
	cfg := config.Config{PDDisaggregation: true}
	if err := cfg.CheckWorker(w); err != nil {
		return config.Worker{}, err
	}
	return w, nil
}
