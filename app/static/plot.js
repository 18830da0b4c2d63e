const tip = document.createElement('div');
tip.style.cssText = 'position:fixed;display:none;pointer-events:none;z-index:1000;background:#fff;' +
  'border:1px solid #999;border-radius:4px;padding:4px;font:12px sans-serif;max-width:220px';
document.body.appendChild(tip);
element.addEventListener('click', (e) => {
  const c = e.target.closest('[data-id]');
  if (c) trigger('click', {id: Number(c.dataset.id)});
});
element.addEventListener('mouseover', async (e) => {
  const c = e.target.closest('[data-id]');
  if (!c) return;
  const id = c.dataset.id;
  tip.dataset.id = id;
  tip.textContent = c.querySelector('title')?.textContent || ('id ' + id);
  tip.style.left = (e.clientX + 14) + 'px'; tip.style.top = (e.clientY + 14) + 'px';
  tip.style.display = 'block';
  const uri = await server.thumb(id);
  if (tip.dataset.id === id && tip.style.display === 'block') {
    const img = document.createElement('img'); img.src = uri; img.style.cssText = 'display:block;max-width:96px';
    tip.prepend(img);
  }
});
element.addEventListener('mouseout', (e) => { if (e.target.closest('[data-id]')) { tip.style.display = 'none'; tip.dataset.id = ''; } });
