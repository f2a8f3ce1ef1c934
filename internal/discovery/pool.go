package discovery

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
)

// InferencePools is the Gateway API Inference Extension's pool resource, version v1.
var InferencePools = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// maxPoolPorts bounds the target ports read from one pool (the API allows a handful).
const maxPoolPorts = 8

// watchPool starts an informer on the one pool d.Pool names; every change re-applies the
// pods. It returns the informer's synced check.
func (d *Discovery) watchPool(ctx context.Context) (cache.InformerSynced, error) {
	f := dynamicinformer.NewFilteredDynamicSharedInformerFactory(d.Dynamic, d.Resync, d.Namespace, func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", d.Pool).String()
	})
	inf := f.ForResource(InferencePools).Informer()
	set := func(obj any) {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok || u.GetName() != d.Pool {
			return
		}
		st := parsePool(u)
		d.mu.Lock()
		was := d.pool
		d.pool = st
		d.mu.Unlock()
		switch {
		case st.err != "" && st.err != was.err:
			d.Log.Error("service discovery: the InferencePool cannot be used: no workers until it is fixed", "pool", d.Pool, "err", st.err)
		case st.err == "" && (!was.found || was.err != "" || was.sel.String() != st.sel.String() || fmt.Sprint(was.ports) != fmt.Sprint(st.ports)):
			d.Log.Info("service discovery: InferencePool", "pool", d.Pool, "selector", st.sel.String(), "target_ports", st.ports)
		}
		d.poke()
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    set,
		UpdateFunc: func(_, o any) { set(o) },
		DeleteFunc: func(any) {
			d.mu.Lock()
			d.pool = poolState{}
			d.mu.Unlock()
			d.Log.Warn("service discovery: the InferencePool was deleted: its workers leave", "pool", d.Pool)
			d.poke()
		},
	}); err != nil {
		return nil, err
	}
	if err := inf.SetWatchErrorHandler(func(_ *cache.Reflector, err error) { d.lost(err) }); err != nil {
		return nil, err
	}
	f.Start(ctx.Done())
	go func() { <-ctx.Done(); f.Shutdown() }()
	return inf.HasSynced, nil
}

// parsePool reads an InferencePool's selector (matchLabels) and target ports.
func parsePool(u *unstructured.Unstructured) poolState {
	st := poolState{found: true}
	ml, _, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil {
		st.err = "spec.selector.matchLabels: " + err.Error()
		return st
	}
	if len(ml) == 0 {
		st.err = "spec.selector.matchLabels is empty: it would select every pod of the namespace"
		return st
	}
	sel, err := labels.ValidatedSelectorFromSet(ml)
	if err != nil {
		st.err = "spec.selector.matchLabels: " + err.Error()
		return st
	}
	ports, _, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil || len(ports) == 0 {
		st.err = "spec.targetPorts: want at least one {number: port}"
		return st
	}
	for i, p := range ports {
		if i == maxPoolPorts {
			break
		}
		m, _ := p.(map[string]any)
		n, ok := m["number"].(int64)
		if !ok || n < 1 || n > 65535 {
			st.err = fmt.Sprintf("spec.targetPorts[%d].number is not a port", i)
			return st
		}
		st.ports = append(st.ports, int(n))
	}
	st.sel = sel
	return st
}

// objectMissing tells a missing object (the API server names it) from a missing resource.
func objectMissing(err error, name string) bool {
	st, ok := err.(apierrors.APIStatus)
	return ok && st.Status().Details != nil && st.Status().Details.Name == name
}

// poolPreflight gets the pool once: Baton may read pools there. A pool that does not exist
// yet is waited for (and said); one Baton may not read stops startup, naming the fix.
func poolPreflight(ctx context.Context, d *Discovery) error {
	ctx, cancel := context.WithTimeout(ctx, preflightTimeout)
	defer cancel()
	_, err := d.Dynamic.Resource(InferencePools).Namespace(d.Namespace).Get(ctx, d.Pool, metav1.GetOptions{})
	switch {
	case err == nil:
		return nil
	case apierrors.IsNotFound(err) && !objectMissing(err, d.Pool):
		return fmt.Errorf("service discovery: the API server does not serve %s (%v): install the Gateway API Inference Extension's CRDs", InferencePools.GroupResource(), err)
	case apierrors.IsNotFound(err):
		d.Log.Warn("service discovery: the InferencePool does not exist (yet): no workers until it does", "namespace", d.Namespace, "pool", d.Pool)
		return nil
	case apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err):
		return fmt.Errorf("service discovery: Baton may not read InferencePools in namespace %q (%v): grant its service account get, list and watch on inferencepools.inference.networking.k8s.io there (the chart's Role does in EPP mode)", d.Namespace, err)
	}
	return fmt.Errorf("service discovery: reading the InferencePool %s/%s: %w", d.Namespace, d.Pool, err)
}
